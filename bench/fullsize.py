"""Full-size models in fp32, bf16 and fp16: eager, torch.compile and ember in one process (issue 40).

GPT-2 small, BERT-base, a Llama-style decoder (RoPE, RMSNorm, GQA, SwiGLU), ResNet-50 and ViT-B/16 at
the sizes people deploy, built from configs with random weights (nothing downloaded), in inference
(`torch.no_grad()`, eval mode) and as a training step (AdamW, loss = mean of the squared output;
"pure": the model in the dtype, "autocast": an fp32 model under `torch.autocast(dtype)`). Per row:
the median of --calls timed calls after warm-up (training: --calls // 2 steps), the columns' calls
interleaved (one call of each per round: a host whose speed drifts during the row slows every column
alike; --sequential times each column alone in turn), each compiler's
first-call (compile) time, its output (in inference also the KV cache a language model returns)
checked against eager's within the dtype's tolerance, and the ratios to eager and to the faster of
eager and torch.compile (issue 40's target). A graph break, or a training region that ember split
(eager autograd around an op without a derivative rule), is printed under its row with the first
reason. With --profile, each compiler's device time per call
and top kernels (torch.profiler, 5 calls) are printed, so that a slow row shows its cause. A column
"ember:key=value;key=value" runs ember with those ember.config options set while it compiles and
runs (an A/B of an option in one process); it needs --sequential: ember's cache entries guard a
module's attributes, not its identity, so interleaved columns of one model's copies would share the
first ember column's compiled code (found 2026-12-01: the second column's "first s" was 0.0).

    python bench/fullsize.py --device cuda                           # every model, bf16 inference
    python bench/fullsize.py --device cuda --dtypes fp32,bf16,fp16 --modes infer,train
    python bench/fullsize.py --device cuda --models bert --profile
    python bench/fullsize.py --size small                            # dev VM: the same code, 2 layers
    python bench/fullsize.py --device cuda --models gpt2,bert,llama --attn eager   # hand-written attention
    python bench/fullsize.py --device cuda --modes train --sequential --compilers eager,torch.compile,ember,ember:decompose_layer_norm=False

TF32 is off (`torch.backends.cuda.matmul.allow_tf32 = False`), as in shared/anchors. ResNet-50 and
ViT-B/16 come from torchvision when it imports, else from transformers (ResNetConfig / ViTConfig
defaults are the same networks). Timings are never asserted by tests.
"""
import argparse
import ast
import contextlib
import copy
import json
import math
import platform
import statistics
import sys
import time

import torch

import ember

# model -> (inference batch, training batch); sequence 512 for the language models, 224 x 224 images
FULL = {"gpt2": (8, 4), "bert": (8, 4), "llama": (4, 4), "resnet50": (64, 32), "vit": (32, 16)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# output tolerance against eager (max abs difference over the output's max abs value)
TOL = {torch.float32: 2e-3, torch.bfloat16: 6e-2, torch.float16: 2e-2}


def build(name, size, mode, attn=None):
    """(model, input) for one model; small: 2 layers / narrow, for the CPU. attn: transformers'
    attn_implementation for the language models ("eager": their hand-written attention)."""
    torch.manual_seed(0)
    small = size == "small"
    batch = (2 if small else FULL[name][0 if mode == "infer" else 1])
    if name in ("gpt2", "bert", "llama"):
        import transformers as tf
        seq = 64 if small else 512
        if name == "gpt2":
            cfg = tf.GPT2Config(n_layer=2, n_embd=128, n_head=4) if small else tf.GPT2Config()
            model = tf.GPT2LMHeadModel(cfg)
        elif name == "bert":
            cfg = (tf.BertConfig(num_hidden_layers=2, hidden_size=128, num_attention_heads=4, intermediate_size=512)
                   if small else tf.BertConfig())
            model = tf.BertModel(cfg)
        else:
            cfg = tf.LlamaConfig(vocab_size=1000 if small else 32000, hidden_size=128 if small else 1024,
                                 intermediate_size=352 if small else 2816, num_hidden_layers=2 if small else 8,
                                 num_attention_heads=4 if small else 16, num_key_value_heads=2 if small else 4,
                                 max_position_embeddings=1024)
            model = tf.LlamaForCausalLM(cfg)
        if attn:
            model.config._attn_implementation = attn
        x = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
        return model, x
    hw = 64 if small else 224
    x = torch.randn(batch, 3, hw, hw, generator=torch.Generator().manual_seed(1))
    try:
        import torchvision
        if name == "resnet50":
            model = torchvision.models.resnet50()
        else:
            model = (torchvision.models.VisionTransformer(hw, 16, 2, 4, 128, 512) if small
                     else torchvision.models.vit_b_16())
    except ImportError:
        import transformers as tf
        if name == "resnet50":
            model = tf.ResNetForImageClassification(tf.ResNetConfig(depths=[1, 1, 1, 1]) if small else tf.ResNetConfig())
        else:
            cfg = (tf.ViTConfig(image_size=hw, num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                                intermediate_size=512) if small else tf.ViTConfig())
            model = tf.ViTForImageClassification(cfg)
    return model, x


def output_tensor(out):
    """The tensor a model call returns (logits / last hidden state)."""
    if isinstance(out, torch.Tensor):
        return out
    for k in ("logits", "last_hidden_state"):
        v = getattr(out, k, None)
        if isinstance(v, torch.Tensor):
            return v
    return out[0]


def cache_tensors(out):
    """The keys and values of the KV cache a language model returned (use_cache's default), in
    order; [] when it returned none. Compared with eager's like the output: a cache that comes back
    wrong is a wrong result as much as wrong logits."""
    cache = getattr(out, "past_key_values", None)
    layers = getattr(cache, "layers", None) or []
    return [t for layer in layers for t in (getattr(layer, "keys", None), getattr(layer, "values", None))]


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def make_step(model, compiled, x, mode, dtype, device):
    """A no-argument callable running one call (inference) or one AdamW step (training)."""
    if mode == "infer":
        def step():
            with torch.no_grad():
                return output_tensor(compiled(x))
        return step
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = mode == "autocast"

    def step():
        if autocast:
            with torch.autocast(device, dtype=dtype):
                out = output_tensor(compiled(x))
        else:
            out = output_tensor(compiled(x))
        loss = out.float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return out.detach()
    return step


def median_ms(step, calls, device):
    for _ in range(3):
        step()
    sync(device)
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        step()
        sync(device)
        ts.append((time.perf_counter() - t) * 1e3)
    return statistics.median(ts)


def is_annotation(e):
    """Is profiler event e a range (Optimizer.step, Inductor's "Call CompiledFxGraph"), not a kernel?"""
    return getattr(e, "is_user_annotation", False) or e.key.startswith(("## ", "Optimizer."))


def top_kernels(step, device, n=8):
    """The n kernels that took longest, as (name, total device ms over 5 calls, count), after a first
    row ("all kernels", device ms per call, kernels per call; user annotations such as Optimizer.step
    left out since 2026-12-01, whose ranges the total counted before): device time well under the
    wall time says the row is bound by host time, not by its kernels."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        for _ in range(5):
            step()
        sync(device)
    key = "device_time_total" if device == "cuda" else "self_cpu_time_total"
    rows = []
    for e in prof.key_averages():
        t = getattr(e, key, 0) or getattr(e, "cuda_time_total", 0)
        if device == "cuda" and getattr(e, "device_type", None) is not None and "CUDA" not in str(e.device_type):
            continue
        if is_annotation(e):
            continue
        if t:
            rows.append((e.key, t / 1e3, e.count))
    rows.sort(key=lambda r: -r[1])
    total = ("all kernels, per call", sum(r[1] for r in rows) / 5, sum(r[2] for r in rows) // 5)
    return [total] + rows[:n]


def compile_with(compiler, model, reset=True):
    """model compiled by compiler ("eager": model itself); reset: the compiler's caches dropped first."""
    if compiler == "eager":
        return model
    if compiler == "torch.compile":
        if reset:
            torch._dynamo.reset()
        return torch.compile(model)
    if reset:
        ember.reset()
    return ember.compile(model)


@contextlib.contextmanager
def ember_options(compiler):
    """"ember:key=value;key=value": ember.config's options set while that column compiles and runs
    (an A/B of an option in one process: --compilers eager,torch.compile,ember,ember:decompose_layer_norm=False),
    restored after; other compilers: nothing."""
    opts = {}
    if compiler.startswith("ember:"):
        for item in compiler[len("ember:"):].split(";"):
            key, _, value = item.partition("=")
            opts[key.strip()] = ast.literal_eval(value.strip())
    old = {k: getattr(ember.config, k) for k in opts}  # AttributeError names an unknown option
    try:
        for k, v in opts.items():
            setattr(ember.config, k, v)
        yield compiler.split(":")[0]
    finally:
        for k, v in old.items():
            setattr(ember.config, k, v)


def run_row(name, dtype_name, mode, args):
    """One row: each column compiled, its first call timed and its output checked against the first
    column's (run_compiler), then the columns' steps timed. Interleaved (the default): every column
    keeps its own model copy and compiled code, and the timed calls go round the columns (eager, tc,
    ember, eager, tc, ember ...), so that a change in the host's speed during the row (this GPU host
    moved one column's step by up to 40% between calls) falls on every column alike; --sequential:
    each column timed alone in turn, its model freed before the next one (less memory)."""
    dtype = DTYPES[dtype_name]
    device = args.device
    base, x = build(name, args.size, "infer" if mode == "infer" else "train", args.attn)
    if mode != "autocast":
        base = base.to(dtype=dtype)
    base = base.to(device)
    base.train(mode != "infer")
    if mode != "infer" and hasattr(base, "config"):  # dropout off: outputs comparable across compilers
        base.eval()
    x = x.to(device)
    if x.is_floating_point() and mode != "autocast":
        x = x.to(dtype)
    row = {"model": name, "dtype": dtype_name, "mode": mode, "batch": x.shape[0]}
    ref = {}
    calls = args.calls if mode == "infer" else max(3, args.calls // 2)
    steps = {}
    if args.interleave:  # one reset for the row: every column's compiled code stays alive
        torch._dynamo.reset()
        ember.reset()
    for compiler in args.compilers:
        # a copy per column when the columns live side by side: ember's cache entries of two
        # ember columns (other options) are told apart by their module's identity
        model = base if mode == "infer" and not args.interleave else copy.deepcopy(base)
        try:
            with ember_options(compiler) as kind:
                step, entries = run_compiler(compiler, kind, model, x, mode, dtype, device, args, ref,
                                             reset=not args.interleave)
            row.update(entries)
            if args.interleave:
                steps[compiler] = with_options(compiler, step)
            else:
                row.update(time_columns({compiler: step}, calls, device, args))
        except Exception as e:  # a failure is a row of the table, not the end of the run
            row[f"{compiler} error"] = f"{type(e).__name__}: {e}"[:300]
        del model
        if device == "cuda" and not args.interleave:
            torch.cuda.empty_cache()
    if steps:
        try:
            row.update(time_columns(steps, calls, device, args))
        except Exception as e:
            row["timing error"] = f"{type(e).__name__}: {e}"[:300]
    return row


def with_options(compiler, step):
    """step, run inside the ember.config options of an "ember:key=value" column (ember_options)."""
    if not compiler.startswith("ember:"):
        return step

    def run():
        with ember_options(compiler):
            return step()
    return run


def time_columns(steps, calls, device, args):
    """{compiler: step} -> each column's median ms of `calls` timed calls after 3 warm-up calls each,
    the calls going round the columns (one call of each per round); with --profile its top kernels."""
    for step in steps.values():
        for _ in range(3):
            step()
    sync(device)
    ts = {c: [] for c in steps}
    for _ in range(calls):
        for c, step in steps.items():
            t = time.perf_counter()
            step()
            sync(device)
            ts[c].append((time.perf_counter() - t) * 1e3)
    row = {f"{c} ms": statistics.median(v) for c, v in ts.items()}
    if args.profile:
        for c, step in steps.items():
            row[f"{c} kernels"] = top_kernels(step, device)
    return row


def run_compiler(compiler, kind, model, x, mode, dtype, device, args, ref, reset=True):
    """One column of a row: compile with `kind` ("eager", "torch.compile", "ember"), time its first
    call, compare the output with the first column's (ref: a dict the first column fills). Returns
    (the step, the column's entries of the row)."""
    row = {}
    compiled = compile_with(kind, model, reset)
    step = make_step(model, compiled, x, mode, dtype, device)
    sync(device)
    t = time.perf_counter()
    out = step()
    sync(device)
    first = time.perf_counter() - t
    kv = []
    if mode == "infer":  # the whole output once more: the KV cache too
        with torch.no_grad():
            kv = [t.float() if isinstance(t, torch.Tensor) else t for t in cache_tensors(compiled(x))]
    if not ref:
        ref.update(out=out.float(), dtype=out.dtype, kv=kv)
    else:
        err = ((out.float() - ref["out"]).abs().max() / ref["out"].abs().max().clamp_min(1e-6)).item()
        for a, b in zip(kv, ref["kv"]):
            same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
            err = max(err, ((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item() if same else float("inf"))
        if len(kv) != len(ref["kv"]):
            err = float("inf")
        row[f"{compiler} err"] = err
        row[f"{compiler} ok"] = err <= TOL[dtype] * (1 if mode == "infer" else 4) and out.dtype == ref["dtype"]
    row[f"{compiler} first s"] = first
    if compiler == "ember":
        # (entries so far: an "ember:..." column listed before "ember" would count here too)
        info = list(ember.cache_info(compiled))
        row["ember graphs"] = len(info)
        # a training region split around ops it has no rule for (eager autograd between the
        # pieces) costs host time per piece: printed under the row with the first reason
        splits = [a for e in info if isinstance(a := e.get("autograd"), dict) and a.get("split")]
        if splits:
            row["ember split"] = (sum(len(a.get("steps", [])) for a in splits), splits[0]["split"][0])
        # a graph break (or a fallback) splits the model into several regions with Python
        # between them: printed under the row with the first reason
        breaks = [e for e in ember.cache_info(compiled, resume=True) if e["kind"] != "graph"]
        if breaks:
            b = breaks[0]
            row["ember breaks"] = (len(breaks), f"{b['kind']} in {b['code']}: {b.get('reason_text')} "
                                                f"({b.get('detail')}; {b.get('filename')}:{b.get('lineno')})")
    return step, row


def fmt(row, compilers):
    cells = [row["model"], row["dtype"], row["mode"], str(row["batch"])]
    for c in compilers:
        cells.append(f"{row[c + ' ms']:.2f}" if c + " ms" in row else "error")
    best = min((row[c + " ms"] for c in ("eager", "torch.compile") if c + " ms" in row), default=None)
    if "ember ms" in row and best:
        cells.append(f"{best / row['ember ms']:.2f}")
    if "ember ms" in row and "torch.compile ms" in row:
        cells.append(f"{row['torch.compile ms'] / row['ember ms']:.2f}")
    for c in compilers[1:]:
        if c + " first s" in row:
            cells.append(f"{row[c + ' first s']:.1f}")
    ok = all(row.get(c + " ok", True) for c in compilers[1:])
    cells.append("yes" if ok else "NO " + ", ".join(f"{c} {row.get(c + ' err', 0):.1e}" for c in compilers[1:]
                                                   if not row.get(c + " ok", True)))
    return "| " + " | ".join(cells) + " |"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--size", choices=["full", "small"], default=None, help="default: full on CUDA, small on CPU")
    ap.add_argument("--models", default="gpt2,bert,llama,resnet50,vit")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--modes", default="infer", help="infer, train (pure dtype), autocast (fp32 model, autocast)")
    ap.add_argument("--compilers", default="eager,torch.compile,ember")
    ap.add_argument("--calls", type=int, default=15)
    ap.add_argument("--profile", action="store_true", help="print each compiler's top kernels")
    ap.add_argument("--attn", default=None, help='transformers attn_implementation ("eager": hand-written attention)')
    ap.add_argument("--sequential", dest="interleave", action="store_false",
                    help="time each column alone in turn (default: interleaved, one call of each column per round)")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    args.size = args.size or ("full" if args.device == "cuda" else "small")
    args.compilers = args.compilers.split(",")
    if args.interleave and sum(c.split(":")[0] == "ember" for c in args.compilers) > 1:
        ap.error("several ember columns share their compiled code when interleaved: add --sequential")
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    import transformers
    dev = torch.cuda.get_device_name() if args.device == "cuda" else f"{platform.machine()} CPU"
    print(f"# {dev}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"python {platform.python_version()}, size {args.size}, "
          f"{'columns interleaved' if args.interleave else 'columns timed in turn (--sequential)'}")
    head = ["model", "dtype", "mode", "batch"] + [c + " ms" for c in args.compilers]
    if "ember" in args.compilers:
        head += ["ember / best(eager, tc)"] + (["ember / tc"] if "torch.compile" in args.compilers else [])
    head += [c + " first s" for c in args.compilers[1:]] + ["equal to eager"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    rows = []
    for name in args.models.split(","):
        for dt in args.dtypes.split(","):
            for mode in args.modes.split(","):
                row = run_row(name, dt, mode, args)
                rows.append(row)
                print(fmt(row, args.compilers), flush=True)
                for c in args.compilers + ["timing"]:
                    if c + " error" in row:
                        print(f"    {c}: {row[c + ' error']}")
                if "ember breaks" in row:
                    print(f"    ember: {row['ember breaks'][0]} graph break(s) or fallback(s); first: "
                          f"{row['ember breaks'][1][:200]}")
                if "ember split" in row:
                    print(f"    ember: the training region split into {row['ember split'][0]} steps; first reason: "
                          f"{row['ember split'][1][:160]}")
                if args.profile:
                    for c in args.compilers:
                        for k, ms, cnt in row.get(c + " kernels", []):
                            print(f"    {c:14s} {ms:8.2f} ms {cnt:5d}x  {k[:110]}")
    sp = [r["torch.compile ms"] / r["ember ms"] for r in rows if "ember ms" in r and "torch.compile ms" in r]
    if sp:
        print(f"# geomean ember speed / torch.compile: {math.exp(sum(map(math.log, sp)) / len(sp)):.2f} over {len(sp)} rows")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)


if __name__ == "__main__":
    sys.exit(main())
