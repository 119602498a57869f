"""Encoder-decoder models (T5, BART) from configs: eager, torch.compile and ember in one process (issue 46).

Each model is built from a config with random weights (nothing is downloaded), run under
torch.no_grad() with the same inputs by every compiler; per compiler: the per-call time (median of
`--calls` timed calls after `--warmup` calls), how many frames were compiled over all calls (ember:
cache entries made, from its perf log; torch.compile: Dynamo's frame and graph counters), how many
of those came after the warm-up (a compiler that recompiles on every call shows it here), and
whether the outputs equal eager's (the largest difference relative to eager's largest value: 1e-4 in
fp32, 5e-2 in bf16/fp16).

    python bench/encoder_decoder.py                                   # dev VM: tiny configs, CPU
    python bench/encoder_decoder.py --device cuda --size full --dtype bf16
    python bench/encoder_decoder.py --models t5 --compilers eager,ember --json out.json
    python bench/encoder_decoder.py --device cuda --size full --models t5 --profile   # top kernels
    python bench/encoder_decoder.py --device cuda --size full --models t5 --rounds 5  # interleaved

--size tiny: T5 2 layers d 128, BART 2+2 layers d 64, batch 2 x 16 (decoder 8) tokens (the issue's
configs); --size full: T5 6 layers d 512 (t5-small's shape), BART 6+6 layers d 768 (bart-base's),
batch 8 x 512 (decoder 128). torch.compile runs with backend "inductor" unless --tc-backend says
otherwise ("eager" counts graphs without Inductor's compile time).
"""
import argparse
import json
import statistics
import sys
import time

import torch

import ember
from ember.testing.counting import count_compiles

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from fullsize import top_kernels  # noqa: E402


def build(name: str, size: str, device: str, dtype: torch.dtype):
    from transformers import BartConfig, BartModel, T5Config, T5Model
    torch.manual_seed(0)
    if name == "t5":
        kw = (dict(d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4) if size == "tiny"
              else dict(d_model=512, d_kv=64, d_ff=2048, num_layers=6, num_heads=8))
        model = T5Model(T5Config(vocab_size=1000, decoder_start_token_id=0, **kw))
    else:
        kw = (dict(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                   encoder_ffn_dim=128, decoder_ffn_dim=128) if size == "tiny"
              else dict(d_model=768, encoder_layers=6, decoder_layers=6, encoder_attention_heads=12,
                        decoder_attention_heads=12, encoder_ffn_dim=3072, decoder_ffn_dim=3072))
        model = BartModel(BartConfig(vocab_size=1000, max_position_embeddings=1024, **kw))
    model = model.eval().to(device=device, dtype=dtype)
    b, s, t = (2, 16, 8) if size == "tiny" else (8, 512, 128)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (b, s), generator=g).to(device)
    dec = torch.randint(0, 1000, (b, t), generator=g).to(device)
    return model, {"input_ids": ids, "decoder_input_ids": dec}


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def run(compiler, model, inputs, args):
    counts = {}
    if compiler == "eager":
        fn = model
    elif compiler == "torch.compile":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters
        dynamo.reset()
        counters.clear()
        fn = torch.compile(model, backend=args.tc_backend)
    else:
        ember.reset()
        counter = count_compiles().__enter__()
        fn = ember.compile(model)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = fn(**inputs).last_hidden_state
        sync(args.device)
        first = time.perf_counter() - t0
        for _ in range(args.warmup - 1):
            fn(**inputs)
        after_warm = None
        if compiler == "torch.compile":
            after_warm = counters["stats"]["unique_graphs"]
        elif compiler == "ember":
            after_warm = counter.entries
        times = timed_calls(fn, inputs, args)
    if compiler == "torch.compile":
        counts = {"graphs": counters["stats"]["unique_graphs"], "frames": counters["frames"]["ok"],
                  "new_after_warmup": counters["stats"]["unique_graphs"] - after_warm}
    elif compiler == "ember":
        counter.__exit__(None, None, None)
        counts = {"entries": counter.entries, "graphs": counter.graphs, "skipped_frames": counter.skipped,
                  "new_after_warmup": counter.entries - after_warm}
    if args.profile:
        with torch.no_grad():
            for name, ms, n in top_kernels(lambda: fn(**inputs), args.device, n=12):
                print(f"    {ms:9.3f} ms {n:6d}  {name[:110]}")
    return out, statistics.median(times), first, counts, fn


def timed_calls(fn, inputs, args):
    """args.calls calls of fn, each timed alone (synchronized before and after): seconds."""
    times = []
    with torch.no_grad():
        for _ in range(args.calls):
            sync(args.device)
            t = time.perf_counter()
            fn(**inputs)
            sync(args.device)
            times.append(time.perf_counter() - t)
    return times


def interleaved_rounds(name, fns, first_ms, inputs, args):
    """args.rounds - 1 more rounds of args.calls timed calls per compiler, the compilers' order
    reversed every other round (a machine that speeds up or slows down during the run favours
    nobody): per compiler the median of each round, and the median over rounds."""
    per = {c: [ms] for c, ms in first_ms.items()}
    comps = list(fns)
    for r in range(1, args.rounds):
        for c in (comps if r % 2 == 0 else comps[::-1]):
            per[c].append(statistics.median(timed_calls(fns[c], inputs, args)) * 1e3)
    for c, ms in per.items():
        print(f"{name:5s} {c:14s} rounds: " + " ".join(f"{m:.3f}" for m in ms) + f"  median {statistics.median(ms):.3f} ms")
    if "ember" in per and "torch.compile" in per:
        ratios = [t / e for t, e in zip(per["torch.compile"], per["ember"])]
        print(f"{name:5s} torch.compile / ember per round: " + " ".join(f"{x:.3f}" for x in ratios) +
              f"  median {statistics.median(ratios):.3f}")
    return {c: statistics.median(ms) for c, ms in per.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="t5,bart")
    ap.add_argument("--compilers", default="eager,torch.compile,ember")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--size", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=1,
                    help="more rounds of --calls timed calls per compiler after the first, interleaved")
    ap.add_argument("--tc-backend", default="inductor")
    ap.add_argument("--profile", action="store_true", help="print each compiler's top kernels (bench/fullsize.py's)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"# {dev}, torch {torch.__version__}, Python {sys.version.split()[0]}, {args.size} configs, {args.dtype}, "
          f"{args.warmup} warm-up calls, median of {args.calls}")
    rows = []
    for name in args.models.split(","):
        model, inputs = build(name, args.size, args.device, dtype)
        ref = None
        fns, first_ms = {}, {}
        for comp in args.compilers.split(","):
            out, t, first, counts, fns[comp] = run(comp, model, inputs, args)
            first_ms[comp] = t * 1e3
            if ref is None:
                ref = out
            # the largest difference from eager's output, relative to its largest value: fp32 within
            # 1e-4, bf16/fp16 within 5e-2 (a 6-layer model's rounding in the low precision)
            err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()
            ok = err <= (1e-4 if dtype == torch.float32 else 5e-2)
            rows.append({"model": name, "compiler": comp, "ms": t * 1e3, "first_s": first, "equal": ok,
                         "max_rel_err": err, **counts})
            extra = " ".join(f"{k}={v}" for k, v in counts.items())
            print(f"{name:5s} {comp:14s} {t * 1e3:9.3f} ms/call  first call {first:7.2f} s  equal={ok} "
                  f"(max err {err:.1e} of max |eager|)  {extra}")
        base = {r["compiler"]: r["ms"] for r in rows if r["model"] == name}
        if args.rounds > 1:
            base = interleaved_rounds(name, fns, first_ms, inputs, args)
            for r in rows:
                if r["model"] == name:
                    r["ms_rounds_median"] = base[r["compiler"]]
        if "eager" in base:
            print("      speed over eager: " + ", ".join(f"{c} x{base['eager'] / ms:.2f}" for c, ms in base.items()
                                                      if c != "eager"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
