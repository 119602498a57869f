"""Training-step benchmark (issue 12): ResNet-18 (batch 16, 3x128x128, SGD) and
nn.TransformerEncoder (d 256, 4 layers, AdamW), one step = forward + loss + backward + optimizer
step. Side by side in one process, interleaved: eager, torch.compile (Inductor), ember
backend="aot_eager" and backend="ember". Reports step time (median of the timed steps, min over
rounds), memory, compile time (first step) and the losses of the last step, which must agree across
compilers: within a few parts in a thousand, since Inductor and backend "ember" (ember.config.fallback_random
False, the default of both) draw dropout masks from their own Philox streams, not eager's. Memory, measured on a steady-state step (after the timed ones, not timed itself):
  step MiB  the most memory the step allocates above what is allocated when it starts, the gradients
            of the previous step already freed (zero_grad(set_to_none=True)): activations, saved
            tensors, the new gradients, optimizer temporaries; from the allocator itself: on CUDA
            torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated() at the step's start;
            on CPU torch's CPU allocator as the profiler reports it (profile_memory=True: each
            allocation and free with the running "Total Allocated"), over the second of two
            profiled steps so that frees of the first step's tensors are seen too;
  peak MiB  (CUDA) torch.cuda.max_memory_allocated() over that step: parameters and optimizer state
            included;
  saved MiB the activation bytes ember's partition saves for the backward (aot_eager / ember).

    .venv/bin/python bench/training.py --quick                 # small shapes, 1 round (dev VM)
    .venv/bin/python bench/training.py --device cuda           # the GPU machine
    options: --models resnet18,transformer (also resnet18_tv: torchvision's in-place forward,
             `out += identity` and ReLU(inplace=True); gpt2 / llama: transformers' GPT2LMHeadModel /
             LlamaForCausalLM, d 256, 4 layers, batch 8, seq 128, AdamW; need the test extra's
             transformers) --compilers eager,inductor,aot_eager,ember
             (also inductor-ro, ember-ro: mode="reduce-overhead", CUDA graphs)
             --steps N --rounds N --threads N --json out.json --cpu-time
             --channels-last   ResNet-18's parameters and input in torch.channels_last (all compilers)
             --activation gelu the transformer's feed-forward activation (default relu)
             --amp bf16|fp16   mixed precision: forward and loss under torch.autocast (fp16 with GradScaler)
             --amp-inside      ... with the autocast block and the loss inside the compiled function
             --profile N   after the table, each compiler's top N ops of one profiled step (torch.profiler:
                           self CPU time on CPU, self device time on CUDA) and its kernel launches
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import ember  # noqa: E402


# ---------------------------------------------------------------- models (no torchvision needed)

class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """torchvision.models.resnet18's layout (BasicBlock, [2, 2, 2, 2])."""

    def __init__(self, num_classes=1000, width=64):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        layers, cin = [], width
        for i, n in enumerate([2, 2, 2, 2]):
            cout = width * 2 ** i
            for j in range(n):
                layers.append(BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 3, 2, 1)
        x = self.layers(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class Encoder(nn.Module):
    def __init__(self, d, layers, vocab=1000, classes=10, activation="relu"):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.1, batch_first=True, activation=activation)
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


class CausalLM(nn.Module):
    """transformers' GPT2LMHeadModel or LlamaForCausalLM (RMSNorm, rotary embeddings under
    @torch.no_grad(), SiLU-gated MLP, grouped-query attention), built from a config (random
    weights, nothing downloaded), returning the next-token logits flattened to (batch * seq, vocab)
    for F.cross_entropy."""

    def __init__(self, kind, d, layers, heads, vocab, seq):
        super().__init__()
        import transformers
        if kind == "gpt2":
            cfg = transformers.GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=seq,
                                          bos_token_id=0, eos_token_id=0, use_cache=False)
            self.lm = transformers.GPT2LMHeadModel(cfg)
        else:
            cfg = transformers.LlamaConfig(hidden_size=d, intermediate_size=4 * d, num_hidden_layers=layers,
                                           num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=vocab,
                                           max_position_embeddings=seq, use_cache=False)
            self.lm = transformers.LlamaForCausalLM(cfg)

    def forward(self, x):
        return self.lm(input_ids=x).logits.flatten(0, 1)


def make_case(name, quick, device, channels_last=False, activation="relu"):
    g = torch.Generator().manual_seed(0)
    if name in ("gpt2", "llama"):
        d, nl, batch, seq = (64, 2, 4, 32) if quick else (256, 4, 8, 128)
        torch.manual_seed(0)
        model = CausalLM(name, d, nl, 4, 1000, seq)
        x = torch.randint(0, 1000, (batch, seq), generator=g)
        y = torch.randint(0, 1000, (batch * seq,), generator=g)
        opt = lambda p: torch.optim.AdamW(p, lr=1e-4)  # noqa: E731
        shape = f"transformers {'GPT-2' if name == 'gpt2' else 'Llama'}, d {d}, {nl} layers, batch {batch}, seq {seq}, AdamW"
    elif name in ("resnet18", "resnet18_tv"):
        batch, hw = (4, 64) if quick else (16, 128)
        if name == "resnet18_tv":  # torchvision's forward verbatim (out += identity, ReLU(inplace=True))
            sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
            from resnet import resnet18
            model = resnet18()
        else:
            model = ResNet18()
        x = torch.randn(batch, 3, hw, hw, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
        opt = lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)  # noqa: E731
        shape = f"batch {batch}, 3x{hw}x{hw}, SGD"
    else:
        d, nl, batch, seq = (128, 2, 8, 32) if quick else (256, 4, 16, 128)
        model = Encoder(d, nl, activation=activation)
        x = torch.randint(0, 1000, (batch, seq), generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        opt = lambda p: torch.optim.AdamW(p, lr=1e-4)  # noqa: E731
        shape = f"d {d}, {nl} layers, batch {batch}, seq {seq}, AdamW" + (f", {activation}" if activation != "relu" else "")
    model, x = model.to(device), x.to(device)
    if channels_last and name.startswith("resnet18"):  # the user's choice of layout, for every compiler alike
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
        shape += ", channels_last"
    return model, x, y.to(device), opt, shape


def compile_with(model, compiler):
    """compiler: eager, inductor, aot_eager, ember; a "-ro" suffix (inductor-ro, ember-ro) adds
    mode="reduce-overhead" (CUDA graphs: Inductor's cudagraph trees, ember._cudagraphs.TrainingGraphs)."""
    mode = "reduce-overhead" if compiler.endswith("-ro") else None
    compiler = compiler.removesuffix("-ro")
    if compiler == "eager":
        return model
    if compiler == "inductor":
        return torch.compile(model, mode=mode)
    return ember.compile(model, backend=compiler, mode=mode)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def trace_events(prof):
    """The chrome-trace events of a finished torch.profiler run (its "[memory]" events carry each
    allocation's "Bytes" and the allocator's running "Total Allocated")."""
    import tempfile
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f)["traceEvents"]
    finally:
        os.unlink(path)


def cpu_step_peak_bytes(step, zero_grad):
    """Peak growth of CPU-allocator memory during one training step (see the module docstring):
    two steps under torch.profiler with profile_memory=True; the second is marked, and its peak
    "Total Allocated" is taken relative to the total when it starts."""
    from torch.profiler import ProfilerActivity, profile, record_function
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
        zero_grad()
        with record_function("ember_bench_measured_step"):
            step()
    events = trace_events(prof)
    span = next(e for e in events if e.get("name") == "ember_bench_measured_step" and e.get("ph") == "X")
    t0, t1 = span["ts"], span["ts"] + span["dur"]
    mem = sorted((e["ts"], e["args"]["Total Allocated"]) for e in events
                 if e.get("name") == "[memory]" and e["args"].get("Device Type", 0) == 0)
    before = [tot for ts, tot in mem if ts < t0]
    base = before[-1] if before else 0
    during = [tot for ts, tot in mem if t0 <= ts <= t1]
    return max(during, default=base) - base


def step_memory(step, zero_grad, device):
    """(step MiB, peak MiB) of one steady-state training step (module docstring)."""
    if device == "cuda":
        zero_grad()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        return (peak - start) / 2 ** 20, peak / 2 ** 20
    return cpu_step_peak_bytes(step, zero_grad) / 2 ** 20, None


def rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def saved_bytes(fn, model):
    """Sum of saved-tensor bytes over ember's compiled regions of this model's entries (None for
    other compilers). Models of one class share their forward's code object, so its cache also
    holds the entries of the other compilers' copies: only those guarding on this model's id
    count (before 2026-11-24 they were summed too: ResNet-18 showed 215.1 MiB for 107.6). With
    --amp-inside the compiled function takes the model as its `model` argument."""
    total = 0
    mine = (f"___id(L['self']) == {id(model)}", f"___id(L['model']) == {id(model)}")
    try:
        info = ember.cache_info(fn)
    except Exception:  # noqa: BLE001  (not an ember-compiled function)
        return None

    def walk(a):
        nonlocal total
        if not a:
            return
        if "saved_bytes" in a:
            total += a["saved_bytes"]
        for st in a.get("steps", []):
            walk(st.get("autograd"))
    for e in (info["entries"] if isinstance(info, dict) else info):
        if any(m in g for m in mine for g in e.get("guards", ())):
            walk(e.get("autograd"))
    return total


def run_model(name, compilers, args, device):
    base, x, y, make_opt, shape = make_case(name, args.quick, device, getattr(args, "channels_last", False),
                                            getattr(args, "activation", "relu"))
    runs = {}
    for c in compilers:
        model = copy.deepcopy(base)
        model.train()
        amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp)
        scaler = torch.amp.GradScaler(device) if args.amp == "fp16" else None
        inside = amp_dtype is not None and getattr(args, "amp_inside", False)
        if inside:  # the autocast block and the loss inside the compiled function
            def loss_fn(x, y, model=model, amp_dtype=amp_dtype):
                with torch.autocast(device, dtype=amp_dtype):
                    return F.cross_entropy(model(x), y)
            fn = compile_with(loss_fn, c)
        else:
            fn = compile_with(model, c)
        opt = make_opt(model.parameters())

        def step(fn=fn, opt=opt, amp_dtype=amp_dtype, scaler=scaler, inside=inside):
            opt.zero_grad(set_to_none=True)
            if inside:
                loss = fn(x, y)
            else:
                with torch.autocast(device, dtype=amp_dtype or torch.bfloat16, enabled=amp_dtype is not None):
                    loss = F.cross_entropy(fn(x), y)
            if scaler is None:
                loss.backward()
                opt.step()
            else:  # float16: the loss scaled, steps with inf/NaN gradients skipped (torch.amp.GradScaler)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            return loss
        rss0 = rss_mib()
        t0 = time.perf_counter()
        torch.manual_seed(1)
        step()
        sync(device)
        compile_s = time.perf_counter() - t0
        runs[c] = {"model": model, "step": step, "zero_grad": lambda opt=opt: opt.zero_grad(set_to_none=True), "times": [], "compile_s": compile_s, "rss_growth_mib": rss_mib() - rss0, "fn": fn}
    for _ in range(args.rounds):
        for c in compilers:
            r = runs[c]
            torch.manual_seed(2)
            ts = []
            clock = time.process_time if args.cpu_time else time.perf_counter
            for _ in range(args.steps):
                t0 = clock()
                loss = r["step"]()
                sync(device)
                ts.append(clock() - t0)
            r["times"].append(statistics.median(ts))
            r["loss"] = float(loss.detach())
    if args.profile:
        for c in compilers:
            runs[c]["profile"] = profile_step(runs[c]["step"], device, args.profile)
    for c in compilers:  # memory of a steady-state step, after the timed ones (profiling slows it)
        torch.manual_seed(3)
        runs[c]["step_mib"], runs[c]["peak_mib"] = step_memory(runs[c]["step"], runs[c]["zero_grad"], device)
    out = {"model": name, "shape": shape, "device": device, "amp": args.amp, "rows": {}}
    for c in compilers:
        r = runs[c]
        out["rows"][c] = {"step_ms": 1e3 * min(r["times"]), "compile_s": r["compile_s"], "peak_mib": r["peak_mib"],
                          "step_mib": r["step_mib"],
                          "rss_growth_mib": r["rss_growth_mib"], "saved_mib": (lambda b: None if b is None else b / 2 ** 20)(
                              saved_bytes(r["fn"], r["model"]) if c in ("aot_eager", "ember", "ember-ro") else None),
                          "last_loss": r["loss"]}
        if "profile" in r:
            out["rows"][c]["profile"] = r["profile"]
    return out


def profile_step(step, device, top):
    """One steady-state step under torch.profiler: {"table": the top ops by self time (device time on
    CUDA), "launches": kernel launches (CUDA), "ops": {op: [calls, self ms]} of the top ones}."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    step()
    sync(device)
    with profile(activities=acts) as prof:
        step()
        sync(device)
    ka = prof.key_averages()
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    launches = sum(e.count for e in ka if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC",
                                                     "cuLaunchKernelEx"))
    rows = sorted(ka, key=lambda e: getattr(e, key), reverse=True)[:top]
    return {"table": ka.table(sort_by=key, row_limit=top), "launches": launches,
            "ops": {e.key: [e.count, getattr(e, key) / 1e3] for e in rows}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--models", default="resnet18,transformer")
    ap.add_argument("--compilers", default="eager,inductor,aot_eager,ember")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", type=int, default=0, metavar="N")
    ap.add_argument("--channels-last", action="store_true", help="ResNet-18's model and input in channels_last")
    ap.add_argument("--activation", choices=["relu", "gelu"], default="relu",
                    help="the transformer's feed-forward activation (gelu: erf's, as BERT's)")
    ap.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                    help="forward and loss under torch.autocast(device, dtype) (fp16: with torch.amp.GradScaler)")
    ap.add_argument("--amp-inside", action="store_true",
                    help="with --amp: the compiled function is the forward and loss with the "
                         "`with torch.autocast` block inside it (the usual AMP step), not the model")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time steps with time.process_time() (CPU time of the process): steadier than wall "
                         "clock on a shared VM; use with --threads 1")
    args = ap.parse_args()
    args.steps = args.steps or (3 if args.quick else 10)
    args.rounds = args.rounds or (1 if args.quick else 3)
    if args.threads:
        torch.set_num_threads(args.threads)
    compilers = args.compilers.split(",")
    print(f"# {platform.platform()}, {os.cpu_count()} CPUs, torch threads {torch.get_num_threads()}, "
          f"Python {platform.python_version()}, torch {torch.__version__}, device {args.device}")
    results = []
    for name in args.models.split(","):
        res = run_model(name, compilers, args, args.device)
        results.append(res)
        eager_ms = res["rows"]["eager"]["step_ms"] if "eager" in res["rows"] else None
        amp = f", autocast {args.amp}{' inside' if args.amp_inside else ''}" if args.amp else ""
        print(f"\n{name} ({res['shape']}{amp}), {args.steps} steps x {args.rounds} rounds")
        print(f"{'compiler':<12} {'step ms':>9} {'vs eager':>9} {'compile s':>10} {'step MiB':>9} {'peak MiB':>9} "
              f"{'saved MiB':>10} {'last loss':>10}")
        for c, r in res["rows"].items():
            ratio = f"{eager_ms / r['step_ms']:.2f}x" if eager_ms else "-"
            peak = f"{r['peak_mib']:.0f}" if r["peak_mib"] is not None else "-"
            saved = f"{r['saved_mib']:.1f}" if r["saved_mib"] is not None else "-"
            print(f"{c:<12} {r['step_ms']:>9.1f} {ratio:>9} {r['compile_s']:>10.2f} {r['step_mib']:>9.1f} {peak:>9} "
                  f"{saved:>10} {r['last_loss']:>10.4f}")
        for c, r in res["rows"].items():
            if "profile" in r:
                print(f"\n{name}, {c}: one profiled step, {r['profile']['launches']} kernel launches")
                print(r["profile"].pop("table"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
