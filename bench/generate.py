"""LLM generation with a KV cache: eager, torch.compile and ember in one process (issue 41).

A Llama-style decoder (RoPE, RMSNorm, GQA, SwiGLU) built from a config with random weights generates
greedily with transformers' `generate()`, the model's forward compiled as transformers documents it
(`model.forward = compile(model.forward)`), with a dynamic cache (DynamicCache: the key/value
tensors grow each step) and a static one (StaticCache: preallocated, updated in place). Per
compiler and cache: the whole generate() (median of --rounds after one warm-up generate), the prefill
(a generate of one new token) and the decode step ((whole - prefill) / (new tokens - 1)), tokens per
second, the frames compiled in the first generate and in the later ones (a compiler that recompiles
per decode step shows it there), and whether the tokens equal eager's. The decode step is set next
to its memory-bandwidth bound: the bytes of the weights and of the cache read per step over the
device's copy bandwidth (measured: a large clone, bytes read and written).

    python bench/generate.py                                       # dev VM: 4 layers d 256, batch 2
    python bench/generate.py --device cuda --size full --dtype bf16  # 8 layers d 1024, batch 4, 128 + 64
    python bench/generate.py --caches dynamic --compilers eager,ember
    python bench/generate.py --device cuda --size full --dtype bf16 --caches static \
        --compilers eager,torch.compile:reduce-overhead,ember:reduce-overhead     # CUDA graphs
    python bench/generate.py --caches loop      # gpt-fast's hand-written loop over a StaticCache

Cache "loop" is the hand-written decode loop of gpt-fast: the prefill is the model's plain forward,
then one compiled `decode_one_token(model, token, cache, position)` per new token over a StaticCache
(the position a tensor, as gpt-fast passes it; one cache per compiler, reset before each run, as
gpt-fast allocates its caches once), its time per step and the frames it compiled.

A compiler "name:mode" passes mode= (torch.compile's modes) to torch.compile or ember.compile.
"""
import argparse
import json
import statistics
import sys
import time

import torch

import ember
from ember.testing.counting import count_compiles


def build(size, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    if size == "tiny":
        cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
        batch, prompt, new = 2, 16, 32
    else:
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                          num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=1024)
        batch, prompt, new = 4, 128, 64
    model = LlamaForCausalLM(cfg).eval().to(device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    return model, cfg, ids, new


def bandwidth(device):
    """Copy bandwidth in bytes/s (read + write) of a 256 MiB clone, median of 5."""
    x = torch.empty(64 << 20, dtype=torch.float32, device=device)
    ts = []
    for _ in range(6):
        sync(device)
        t = time.perf_counter()
        x.clone()
        sync(device)
        ts.append(time.perf_counter() - t)
    return 2 * x.numel() * 4 / statistics.median(ts[1:])


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def frames_so_far(compiler, counter):
    if compiler == "torch.compile":
        from torch._dynamo.utils import counters
        return counters["frames"]["ok"]
    return counter.entries if counter else 0


def timed_generate(model, ids, kw, device):
    sync(device)
    t = time.perf_counter()
    out = model.generate(ids, **kw)
    sync(device)
    return out, time.perf_counter() - t


def decode_one_token(model, token, cache, pos):
    """One greedy decode step (gpt-fast's shape): token (batch, 1) int64, pos (1,) int64 -> (batch, 1)."""
    logits = model(input_ids=token, past_key_values=cache, cache_position=pos, use_cache=True).logits
    return logits[:, -1].argmax(-1, keepdim=True)


def hand_loop(step, model, ids, new, device, cache):
    """Prefill by the plain forward, then new - 1 calls of step; -> (tokens, prefill s, decode s).
    cache: one StaticCache per compiler, emptied here (gpt-fast allocates its caches once)."""
    cache.reset()
    sync(device)
    t0 = time.perf_counter()
    pos = torch.arange(ids.shape[1], device=device)
    tok = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1].argmax(
        -1, keepdim=True)
    sync(device)
    t1 = time.perf_counter()
    toks, pos = [tok], pos[-1:] + 1
    for _ in range(new - 1):
        tok = step(model, tok, cache, pos).clone()  # as gpt-fast: a CUDA graph's output is overwritten by its next replay
        toks.append(tok)
        pos = pos + 1
    sync(device)
    return torch.cat([ids] + toks, 1), t1 - t0, time.perf_counter() - t1


def run_loop(compiler, model, ids, new, args):
    compiler, _, mode = compiler.partition(":")
    counter, step = None, decode_one_token
    if compiler == "torch.compile":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters
        dynamo.reset()
        counters.clear()
        step = torch.compile(decode_one_token, mode=mode or None)
    elif compiler == "ember":
        ember.reset()
        counter = count_compiles().__enter__()
        step = ember.compile(decode_one_token, mode=mode or None)
    from transformers import StaticCache
    cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)
    try:
        with torch.no_grad():
            t = time.perf_counter()
            out = hand_loop(step, model, ids, new, args.device, cache)[0]
            first = time.perf_counter() - t
            f1 = frames_so_far(compiler, counter)
            runs = [hand_loop(step, model, ids, new, args.device, cache) for _ in range(args.rounds)]
            f2 = frames_so_far(compiler, counter)
            kernels = None
            if args.profile:  # the decode step's kernels: 5 steps after a fresh prefill
                from fullsize import top_kernels
                cache.reset()
                pos = torch.arange(ids.shape[1], device=args.device)
                st = {"tok": model(input_ids=ids, past_key_values=cache, cache_position=pos).logits[:, -1:].argmax(-1),
                      "pos": pos[-1:] + 1}

                def one():
                    st["tok"] = step(model, st["tok"], cache, st["pos"]).clone()
                    st["pos"] = st["pos"] + 1
                kernels = top_kernels(one, args.device, n=args.top)
            cg = [e.get("cudagraphs") for e in ember.cache_info(step)] if compiler == "ember" and mode else None
    finally:
        if counter:
            counter.__exit__(None, None, None)
    p = statistics.median(r[1] for r in runs)
    d = statistics.median(r[2] for r in runs)
    w = p + d
    return out, {"first_s": first, "generate_s": w, "prefill_ms": p * 1e3, "decode_ms": d / (new - 1) * 1e3,
                 "tokens_per_s": ids.shape[0] * new / w, "frames_first_generate": f1, "frames_later": f2 - f1,
                 "cudagraphs": cg, "kernels": kernels}


def run(compiler, model, ids, new, cache, args):
    if cache == "loop":
        return run_loop(compiler, model, ids, new, args)
    counter = None
    orig = model.forward
    compiler, _, mode = compiler.partition(":")  # "ember:reduce-overhead": torch.compile's modes
    mode = mode or None
    if compiler == "torch.compile":
        import torch._dynamo as dynamo
        from torch._dynamo.utils import counters
        dynamo.reset()
        counters.clear()
        model.forward = torch.compile(orig, mode=mode)
    elif compiler == "ember":
        ember.reset()
        counter = count_compiles().__enter__()
        model.forward = ember.compile(orig, mode=mode)
    # disable_compile: transformers otherwise torch.compiles the forward by itself for a static cache
    # (GenerationConfig.compile_config), which would measure that instead of the compiler in the row
    kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=0, disable_compile=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    mask = torch.ones_like(ids)
    try:
        with torch.no_grad():
            out, first = timed_generate(model, ids, dict(kw, attention_mask=mask), args.device)
            f1 = frames_so_far(compiler, counter)
            whole, prefill = [], []
            for _ in range(args.rounds):
                whole.append(timed_generate(model, ids, dict(kw, attention_mask=mask), args.device)[1])
                one = dict(kw, attention_mask=mask, max_new_tokens=1, min_new_tokens=1)
                prefill.append(timed_generate(model, ids, one, args.device)[1])
            f2 = frames_so_far(compiler, counter)
            # ember with a mode: whether each entry replays CUDA graphs, or why it launches plainly
            cg = [e.get("cudagraphs") for e in ember.cache_info(model.forward)] if compiler == "ember" and mode else None
    finally:
        model.forward = orig
        if counter:
            counter.__exit__(None, None, None)
    w, p = statistics.median(whole), statistics.median(prefill)
    return out, {"first_s": first, "generate_s": w, "prefill_ms": p * 1e3, "decode_ms": (w - p) / (new - 1) * 1e3,
                 "tokens_per_s": ids.shape[0] * new / w, "frames_first_generate": f1, "frames_later": f2 - f1,
                 "cudagraphs": cg}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--caches", default="dynamic,static")
    ap.add_argument("--compilers", default="eager,torch.compile,ember")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true",
                    help='cache "loop": the decode step\'s device time (first line, per step) and top kernels '
                         '(device ms over 5 steps, launches), torch.profiler')
    ap.add_argument("--top", type=int, default=5, help="with --profile: how many kernels to list")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    model, cfg, ids, new = build(args.size, args.device, dtype)
    dev = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    bw = bandwidth(args.device)
    wbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    kv = lambda n: 2 * cfg.num_hidden_layers * ids.shape[0] * cfg.num_key_value_heads * n * (  # noqa: E731
        cfg.hidden_size // cfg.num_attention_heads) * model.dtype.itemsize
    bound_ms = (wbytes + kv(ids.shape[1] + new // 2)) / (bw / 2) * 1e3  # bytes read once, at half the copy rate
    print(f"# {dev}, torch {torch.__version__}, Python {sys.version.split()[0]}, {args.size}: "
          f"{cfg.num_hidden_layers} layers d {cfg.hidden_size}, batch {ids.shape[0]}, prompt {ids.shape[1]}, "
          f"{new} new tokens, {args.dtype}; copy bandwidth {bw / 1e9:.0f} GB/s; decode step bound "
          f"(weights {wbytes / 2**20:.0f} MiB + mean cache) {bound_ms:.3f} ms")
    rows = []
    for cache in args.caches.split(","):
        ref = None
        for comp in args.compilers.split(","):
            try:
                out, r = run(comp, model, ids, new, cache, args)
            except Exception as e:  # noqa: BLE001  (a compiler that fails here is a row, not the end of the run)
                msg = str(e).strip().splitlines()
                print(f"{cache:8s} {comp:14s} failed: {type(e).__name__}: {msg[0][:300] if msg else ''}")
                rows.append({"cache": cache, "compiler": comp, "error": f"{type(e).__name__}: {e}"[:2000]})
                continue
            ref = out if ref is None else ref
            r.update(cache=cache, compiler=comp, equal=bool(torch.equal(out, ref)),
                     decode_vs_bound=r["decode_ms"] / bound_ms)
            rows.append(r)
            print(f"{cache:8s} {comp:14s} generate {r['generate_s']:7.3f} s ({r['tokens_per_s']:8.1f} tok/s)  "
                  f"prefill {r['prefill_ms']:8.2f} ms  decode {r['decode_ms']:7.3f} ms/step "
                  f"({r['decode_vs_bound']:.1f}x bound)  first {r['first_s']:6.2f} s  frames {r['frames_first_generate']}"
                  f" then {r['frames_later']}  equal={r['equal']}")
            if r["cudagraphs"]:
                cg = [{k: v for k, v in e.items() if k not in ("pool", "recorded_shape")} for e in r["cudagraphs"] if e]
                print(f"    cudagraphs: {cg}")
            for name, ms, count in r.get("kernels") or []:
                print(f"    {ms:8.3f} ms {count:5d}x  {name[:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev, "args": vars(args), "bound_ms": bound_ms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
