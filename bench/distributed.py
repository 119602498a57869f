"""Distributed training steps: GPT-2 small and ResNet-50 under DistributedDataParallel and FSDP2
(fully_shard per block), eager / torch.compile / ember, one process per device (issue 42).

Launch with torchrun, one process per GPU (or per CPU process with gloo):

    torchrun --nproc-per-node 2 bench/distributed.py                       # 2 GPUs, NCCL, bf16
    torchrun --nproc-per-node 2 bench/distributed.py --device cpu --size small --dtype fp32

Per row (rank 0 prints; every rank runs the same steps): the median step time (AdamW, forward,
backward, optimizer) and tokens or images per second over all ranks; on CUDA, from a profile of
3 steps on rank 0, the communication kernels' (NCCL) time per step and the part of it that runs
while a compute kernel runs too ("comm overlapped": the all-reduces or reduce-scatters hidden
behind the backward, the all-gathers behind the forward); for DDP the all-reduce of every
gradient alone (one flat buffer), what the communication costs without overlap. The
parameters after the steps are compared with eager's on the same rank (the largest |difference|
over all parameters, over the largest |eager| parameter). Models are built from configs with random weights (bench/fullsize.py's builders)."""
import argparse
import copy
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fullsize import DTYPES, build, median_ms, output_tensor  # noqa: E402

import ember  # noqa: E402

BATCH = {"gpt2": 8, "resnet50": 32}  # per rank at full size


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def blocks(model):
    """The modules FSDP2 shards one by one: GPT-2's transformer blocks, ResNet's stages."""
    if hasattr(model, "transformer"):
        return list(model.transformer.h)
    return [getattr(model, n) for n in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, n)]


def compiled(compiler, m):
    if compiler == "eager":
        return m
    if compiler == "torch.compile":
        return torch.compile(m)
    return ember.compile(m)


def wrap(kind, compiler, model, device):
    """The module a step calls: DDP(compiled model), or the compiled root of per-block FSDP2."""
    if kind == "ddp":
        return DDP(compiled(compiler, model), device_ids=[device.index] if device.type == "cuda" else None)
    from torch.distributed.fsdp import fully_shard
    for b in blocks(model):
        fully_shard(b)
    fully_shard(model)
    return compiled(compiler, model)


def measure(step, steps, device):
    """The median step time in ms of the slowest rank."""
    ms = torch.tensor([median_ms(step, steps, device.type)], device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    return ms.item()


def allreduce_ms(params, device, reps=5):
    """One all-reduce of a flat buffer as large as every gradient: the communication DDP does."""
    n = sum(p.numel() for p in params)
    buf = torch.zeros(n, dtype=next(iter(params)).dtype, device=device)
    for _ in range(2):
        dist.all_reduce(buf)
    sync(device)
    t = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(buf)
    sync(device)
    return (time.perf_counter() - t) * 1e3 / reps


def comm_profile(step, steps=3):
    """(NCCL kernel ms per step, the fraction of that time during which a compute kernel also
    runs), from torch.profiler's CUDA kernel events of `steps` steps."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    comm, comp = [], []
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or e.time_range.end <= e.time_range.start:
            continue
        (comm if "nccl" in e.name.lower() else comp).append((e.time_range.start, e.time_range.end))
    comp.sort()
    merged = []  # the union of compute kernel intervals
    for a, b in comp:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = sum(b - a for a, b in comm)
    hidden = 0.0
    for a, b in comm:
        for c, d in merged:  # few hundred intervals per step: a plain scan
            if c >= b:
                break
            hidden += max(0.0, min(b, d) - max(a, c))
    return total / 1e3 / steps, (hidden / total if total else 0.0)


def local(p):
    return (p.to_local() if hasattr(p, "to_local") else p).detach().float().cpu()


def run_row(name, kind, args, device, base, x, ref):
    row = {"model": name, "wrap": kind}
    per_item = x.shape[1] if x.dim() == 2 else 1  # tokens per sequence; 1 per image
    for compiler in args.compilers:
        torch._dynamo.reset()
        ember.reset()
        model = copy.deepcopy(base).to(device)
        try:
            call = wrap(kind, compiler, model, device)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

            def step():
                out = output_tensor(call(x))
                out.float().pow(2).mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            t = time.perf_counter()
            step()
            sync(device)
            row[f"{compiler} first s"] = time.perf_counter() - t
            ms = measure(step, args.steps, device)
            row[f"{compiler} ms"] = ms
            row[f"{compiler} items/s"] = args.world * x.shape[0] * per_item / ms * 1e3
            if device.type == "cuda":
                row[f"{compiler} comm ms"], row[f"{compiler} comm overlapped"] = comm_profile(step)
            params = [local(p) for p in model.parameters()]
            if compiler == args.compilers[0]:
                ref[(name, kind)] = params
            else:
                want = ref[(name, kind)]
                err = (max((a - b).abs().max().item() for a, b in zip(params, want))
                       / max(b.abs().max().item() for b in want))
                row[f"{compiler} param err"] = err
        except Exception as e:  # a failure is a row, not the end of the run
            row[f"{compiler} error"] = f"{type(e).__name__}: {e}"[:300]
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if kind == "ddp":
        row["allreduce ms"] = allreduce_ms(list(base.parameters()), device)
    return row


def fmt(row, compilers):
    cells = [row["model"], row["wrap"]]
    for c in compilers:
        cells.append(f"{row[c + ' ms']:.2f}" if c + " ms" in row else "ERR")
    for c in compilers:
        cells.append(f"{row[c + ' items/s']:.0f}" if c + " items/s" in row else "-")
    for c in compilers[1:]:
        a, b = row.get(c + " ms"), row.get(compilers[0] + " ms")
        cells.append(f"{b / a:.2f}" if a and b else "-")
    if "ember ms" in row and "torch.compile ms" in row:
        cells.append(f"{row['torch.compile ms'] / row['ember ms']:.2f}")
    else:
        cells.append("-")
    for c in compilers:
        v = row.get(c + " comm ms")
        cells.append(f"{v:.2f}" if v is not None else "-")
    for c in compilers:
        v = row.get(c + " comm overlapped")
        cells.append(f"{v:.2f}" if v is not None else "-")
    ar = row.get("allreduce ms")
    cells.append(f"{ar:.2f}" if ar else "-")
    for c in compilers[1:]:
        e = row.get(c + " param err")
        cells.append(f"{e:.1e}" if e is not None else "-")
    for c in compilers[1:]:
        v = row.get(c + " first s")
        cells.append(f"{v:.1f}" if v is not None else "-")
    return "| " + " | ".join(cells) + " |"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=("full", "small"), default=None, help="default: full on CUDA, small on CPU")
    ap.add_argument("--models", default="gpt2,resnet50")
    ap.add_argument("--wraps", default="ddp,fsdp2")
    ap.add_argument("--compilers", default="eager,torch.compile,ember")
    ap.add_argument("--dtype", default=None, help="fp32 / bf16 (default: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    args.compilers = args.compilers.split(",")
    cuda = args.device == "cuda"
    args.size = args.size or ("full" if cuda else "small")
    dtype = DTYPES[args.dtype or ("bf16" if cuda else "fp32")]
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, args.world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if rank == 0:
        what = torch.cuda.get_device_name(device) if cuda else "CPU"
        print(f"# {args.world} x {what}, torch {torch.__version__}, python {sys.version.split()[0]}, size {args.size}, "
              f"dtype {args.dtype or ('bf16' if cuda else 'fp32')}, {args.steps} timed steps")
        head = (["model", "wrap"] + [f"{c} ms" for c in args.compilers] + [f"{c} items/s" for c in args.compilers]
                + [f"{c} / {args.compilers[0]} speed" for c in args.compilers[1:]] + ["ember / torch.compile speed"]
                + [f"{c} comm ms" for c in args.compilers] + [f"{c} comm overlapped" for c in args.compilers]
                + ["all-reduce alone ms"]
                + [f"{c} param err" for c in args.compilers[1:]] + [f"{c} first s" for c in args.compilers[1:]])
        print("| " + " | ".join(head) + " |")
        print("|" + "---|" * len(head))
    ref = {}
    for name in args.models.split(","):
        base, x = build(name, args.size, "train")
        if args.size == "full":
            x = x[:1].expand(BATCH[name], *x.shape[1:]).contiguous() if x.shape[0] < BATCH[name] else x[:BATCH[name]]
        base = base.to(dtype)
        if hasattr(base, "config"):
            base.eval()  # dropout off: parameters comparable across compilers
        g = torch.Generator().manual_seed(rank)
        x = (torch.randint(0, base.config.vocab_size, x.shape, generator=g) if not x.is_floating_point()
             else torch.randn(x.shape, generator=g)).to(device)
        if x.is_floating_point():
            x = x.to(dtype)
        for kind in args.wraps.split(","):
            row = run_row(name, kind, args, device, base, x, ref)
            if rank == 0:
                print(fmt(row, args.compilers), flush=True)
                for c in args.compilers:
                    if c + " error" in row:
                        print(f"    {c}: {row[c + ' error']}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
