"""LLM generation with a KV cache (issue 41): `model.forward = ember.compile(model.forward)` under
transformers' generate(), with the dynamic cache (its key/value tensors replaced every step) and the
static one (updated in place at cache_position). The cache objects are new every generate() and
their tensors change every step: they are guarded by what the graph reads (tensor metadata, symbolic
sizes after the first change), never by identity, so the decode steps do not recompile. Tokens equal
eager's; compiles at most torch.compile's (its frames, backend "eager") on the same calls."""
import pytest
import torch

import ember
from ember.testing.counting import count_compiles

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _fresh():
    ember.reset()
    yield
    ember.reset()


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return transformers.LlamaForCausalLM(cfg).eval()


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=256)
    return transformers.GPT2LMHeadModel(cfg).eval()


def generate(model, ids, new, cache):
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids), disable_compile=True)
    if cache == "static":
        kw["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(ids, **kw)


def dynamo_frames(model, ids, new, cache, runs):
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    orig = model.forward
    model.forward = torch.compile(orig, backend="eager")
    try:
        for _ in range(runs):
            generate(model, ids, new, cache)
    finally:
        model.forward = orig
        dynamo.reset()
    return counters["frames"]["ok"]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_generate_compiles_once_per_phase(make, cache, mode):
    """generate() compiles a graph per phase (prefill, decode; the cache length symbolic), no more
    than torch.compile's frames, none in a second generate; under reduce-overhead as well (its
    automatic dynamic keeps only dim 0 static: a DynamicCache's growth compiled once per step
    before the forty-second session)."""
    model = make()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    new = 64 if make is tiny_llama else 24
    ref = generate(model, ids, new, cache)
    orig = model.forward
    model.forward = ember.compile(orig, mode=mode)
    try:
        with count_compiles() as counter:
            out = generate(model, ids, new, cache)
            first = counter.entries
            out2 = generate(model, ids, new, cache)  # a new cache object, the same shapes
    finally:
        model.forward = orig
    assert torch.equal(out, ref) and torch.equal(out2, ref)
    assert counter.entries == first, f"{counter.entries - first} compiles in the second generate"
    assert first <= dynamo_frames(model, ids, new, cache, runs=2), first


def test_static_cache_decode_step_runs_on_the_ember_backend():
    """A static cache's decode step updates its cache tensors (graph inputs) in place and reads them
    afterwards (`cumulative_length.add_(n)`, `keys.index_copy_(2, pos, k)`): with the inputs guarded
    apart (___no_overlap) the graph is ember's kernels and extern calls, not the eager backend;
    tokens equal eager's."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    ref = generate(model, ids, 12, "static")
    orig = model.forward
    model.forward = ember.compile(orig)
    try:
        out = generate(model, ids, 12, "static")
        infos = ember.cache_info(model.forward)
    finally:
        model.forward = orig
    assert torch.equal(out, ref)
    decode = max(infos, key=lambda e: e["hits"])  # the step every new token takes
    assert not decode["ember"].get("fallback"), decode["ember"]["fallback"]
    assert any(g.startswith("___no_overlap(") for g in decode["guards"]), decode["guards"]


def test_hand_written_decode_loop():
    """gpt-fast's shape: one compiled decode_one_token(model, token, cache) over many steps."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(2))

    def decode_one_token(model, token, past):
        out = model(input_ids=token, past_key_values=past, use_cache=True)
        return out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values

    def loop(step):
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True)
            tok, past = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
            toks = [tok]
            for _ in range(20):
                tok, past = step(model, tok, past)
                toks.append(tok)
        return torch.cat(toks, 1)

    ref = loop(decode_one_token)
    c = ember.compile(decode_one_token)
    torch.testing.assert_close(loop(c), ref)
    es = ember.cache_info(c)
    assert len(es) <= 2 and sum(e["hits"] for e in es) >= 18, [(e["kind"], e["hits"], e["dynamic"]) for e in es]


def top_p_sample(logits, temperature: float, top_p: float):
    probs = torch.softmax(logits / temperature, -1)
    sp, idx = torch.sort(probs, descending=True)
    cum = sp.cumsum(-1)
    sp = torch.where(cum - sp > top_p, torch.zeros_like(sp), sp)
    return idx.gather(-1, torch.multinomial(sp, 1))


def top_k_sample(logits, temperature: float, top_k: int, gen):
    logits = logits / max(temperature, 1e-5)
    v, _ = torch.topk(logits, top_k)
    logits = torch.where(logits < v[:, -1:], torch.full_like(logits, -float("inf")), logits)
    return torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)


@pytest.mark.parametrize("backend", ["eager", "ember"])
def test_sampling_equals_eager_and_does_not_recompile(backend):
    """Temperature, top-p and multinomial on torch's global generator: one graph, eager's draws for
    the same seed. An explicit torch.Generator argument is a graph break with its reason (the draw
    runs in Python), still one entry over every step."""
    c = ember.compile(top_p_sample, backend=backend)
    for step in range(6):
        logits = torch.randn(2, 100)
        torch.manual_seed(step)
        want = top_p_sample(logits, 0.7, 0.9)
        torch.manual_seed(step)
        assert torch.equal(c(logits, 0.7, 0.9), want)
    assert [e["kind"] for e in ember.cache_info(c)] == ["graph"]
    k = ember.compile(top_k_sample, backend=backend)
    for step in range(6):
        logits = torch.randn(2, 100)
        want = top_k_sample(logits, 0.8, 10, torch.Generator().manual_seed(step))
        assert torch.equal(k(logits, 0.8, 10, torch.Generator().manual_seed(step)), want)
    (e,) = ember.cache_info(k)
    assert e["kind"] == "break" and "Generator" in e["detail"] and e["hits"] == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_gpu_bf16_first_step_logits_and_tokens(cache):
    """On CUDA in bf16 (issue 41's GPU check): the prefill's logits through the compiled forward are
    eager's within bf16's tolerance, and a short greedy generate gives eager's tokens wherever eager's
    top two logits are not within bf16's rounding of each other (the first steps)."""
    model = tiny_llama().to("cuda", torch.bfloat16)
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        want = model(ids).logits
    orig = model.forward
    model.forward = ember.compile(orig)
    try:
        with torch.no_grad():
            got = model(ids).logits
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
        toks = generate(model, ids, 4, cache)
    finally:
        model.forward = orig
    ref = generate(model, ids, 4, cache)
    assert toks.shape == ref.shape
    # the first new token: argmax of the prefill's last logits, where eager's margin exceeds bf16's step
    top2 = want[:, -1].float().topk(2).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    assert torch.equal(toks[clear, 12], ref[clear, 12])


def static_decode_loop(step, model, ids, new, cache):
    """gpt-fast's loop over a StaticCache: the plain forward's prefill, then new - 1 calls of
    step(model, token, cache, position) with the position a tensor; -> the tokens (batch, new)."""
    pos = torch.arange(ids.shape[1], device=ids.device)
    with torch.no_grad():
        tok = model(input_ids=ids, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1].argmax(
            -1, keepdim=True)
        toks, pos = [tok], pos[-1:] + 1
        for _ in range(new - 1):
            tok = step(model, tok, cache, pos).clone()
            toks.append(tok)
            pos = pos + 1
    return torch.cat(toks, 1)


def decode_one_token(model, token, cache, pos):
    return model(input_ids=token, past_key_values=cache, cache_position=pos, use_cache=True).logits[:, -1].argmax(
        -1, keepdim=True)


def test_static_cache_decode_loop_runs_on_the_ember_backend():
    """gpt-fast's loop over a StaticCache: one graph for every step and every new cache, on ember's
    backend (transformers 5's Llama reads the cache's counter through `.to(device)`, an alias of an
    input the step updates in place: allowed, its readers run before the update); eager's tokens."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(3))

    def fresh():
        return transformers.StaticCache(config=model.config, max_cache_len=20)

    want = static_decode_loop(decode_one_token, model, ids, 12, fresh())
    step = ember.compile(decode_one_token)
    for _ in range(2):
        assert torch.equal(static_decode_loop(step, model, ids, 12, fresh()), want)
    (e,) = ember.cache_info(step)
    assert e["kind"] == "graph" and e["hits"] == 21, (e["kind"], e["hits"])
    assert not e["ember"].get("fallback"), e["ember"]["fallback"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_decode_loop_replays_a_cuda_graph_per_token():
    """mode="reduce-overhead" on a hand-written decode loop over a StaticCache (issue 41 item 3): the
    decode step is recorded once at the cache's addresses and every later token is a replay; a new
    cache (the next generation) records again; the tokens are eager's."""
    model = tiny_llama().to("cuda")
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(3)).cuda()
    new = 12

    def fresh():
        return transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + new)

    want = static_decode_loop(decode_one_token, model, ids, new, fresh())
    step = ember.compile(decode_one_token, mode="reduce-overhead")
    for _ in range(2):  # two generations, each with its own cache
        assert torch.equal(static_decode_loop(step, model, ids, new, fresh()), want)
    (entry,) = [e for e in ember.cache_info(step) if e["hits"]]
    cg = entry["cudagraphs"]
    assert cg["state"] == "recorded", cg
    assert cg["rerecords"] == 1 and cg["replays"] >= 2 * (new - 1) - 2, cg


# ---- bad input and unusual use (issue 41's list): eager's outcome, compiles counted -------------

def test_decoding_past_the_static_cache_raises_eagers_error():
    """One token past a StaticCache's length: index_copy_'s IndexError, as eager's, from the
    compiled step; the steps before it gave eager's tokens."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(4))

    def run(step):
        cache = transformers.StaticCache(config=model.config, max_cache_len=12)  # 8 + 4 tokens fit
        toks = static_decode_loop(step, model, ids, 5, cache)  # the prefill and 4 steps: 12 positions
        with pytest.raises(IndexError) as e, torch.no_grad():
            step(model, toks[:, -1:], cache, torch.tensor([12]))
        return toks, str(e.value)

    want, want_msg = run(decode_one_token)
    got, got_msg = run(ember.compile(decode_one_token))
    assert torch.equal(got, want) and got_msg == want_msg, (got_msg, want_msg)


def test_batch_size_and_dtype_changes_recompile_and_give_eagers_tokens():
    """generate() with the batch size changed, then the model's dtype changed: compiles that
    count_compiles sees (no stale guard), no more than torch.compile's frames on the same calls, and
    eager's tokens each time."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    calls = ((2, torch.float32), (3, torch.float32), (3, torch.float64))

    def run(model):
        outs = []
        for batch, dtype in calls:
            model.to(dtype)
            ids = torch.randint(1, 128, (batch, 6), generator=torch.Generator().manual_seed(batch))
            outs.append(generate(model, ids, 6, "dynamic"))
        return outs

    model = tiny_llama()
    want = run(model)
    orig = model.forward
    model.to(torch.float32)
    model.forward = ember.compile(orig)
    try:
        with count_compiles() as counter:
            got = run(model)
    finally:
        model.forward = orig
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    dynamo.reset()
    counters.clear()
    model.to(torch.float32)
    model.forward = torch.compile(orig, backend="eager")
    try:
        run(model)
    finally:
        model.forward = orig
        dynamo.reset()
    frames = counters["frames"]["ok"]
    assert 2 < counter.entries <= frames, (counter.entries, frames)


def test_beam_search_gives_eagers_tokens():
    """Beam search (num_beams=3: generate() reorders the cache between steps, outside the compiled
    forward): eager's sequences, no compile in a second generate, no more entries than
    torch.compile's frames."""
    model = tiny_llama()
    ids = torch.randint(1, 128, (2, 6), generator=torch.Generator().manual_seed(5))
    kw = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids), disable_compile=True)
    with torch.no_grad():
        want = model.generate(ids, **kw)
        orig = model.forward
        model.forward = ember.compile(orig)
        try:
            with count_compiles() as counter:
                got = model.generate(ids, **kw)
                first = counter.entries
                again = model.generate(ids, **kw)
        finally:
            model.forward = orig
    assert torch.equal(got, want) and torch.equal(again, want)
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    dynamo.reset()
    counters.clear()
    model.forward = torch.compile(orig, backend="eager")
    try:
        with torch.no_grad():
            model.generate(ids, **kw)
    finally:
        model.forward = orig
        dynamo.reset()
    assert counter.entries == first and first <= counters["frames"]["ok"], (first, counter.entries, counters["frames"])


class _ListCache:
    """A cache class ember has never seen: per layer, lists of key/value chunks concatenated on
    read (its own update, no transformers base class)."""

    def __init__(self):
        self.k, self.v = {}, {}

    def update(self, k, v, layer):
        self.k.setdefault(layer, []).append(k)
        self.v.setdefault(layer, []).append(v)
        return torch.cat(self.k[layer], -2), torch.cat(self.v[layer], -2)


def test_a_cache_class_never_seen_gives_eagers_results():
    """A decode step over a user's own cache object (a list per layer that grows every step, read
    whole): eager's outputs at every step and the cache's contents as eager's. Every step reads one
    more list item, so every step compiles (a guard on the list's length, never a stale entry), as
    torch.compile does on the same calls: no more entries than its frames."""
    import torch._dynamo as dynamo
    from torch._dynamo.utils import counters
    torch.manual_seed(0)
    wq, wk, wv = (torch.randn(16, 16) for _ in range(3))
    xs = [torch.randn(1, 1, 16) for _ in range(6)]

    def step(x, cache):
        k, v = cache.update(x @ wk, x @ wv, 0)
        att = torch.softmax((x @ wq) @ k.transpose(-1, -2) / 4, -1)
        return att @ v

    c = ember.compile(step)
    ce, cc = _ListCache(), _ListCache()
    with count_compiles() as counter:
        for x in xs:
            torch.testing.assert_close(c(x, cc), step(x, ce))
    assert len(cc.k[0]) == len(ce.k[0]) == len(xs)
    for a, b in zip(cc.k[0], ce.k[0]):
        torch.testing.assert_close(a, b)
    dynamo.reset()
    counters.clear()
    d = torch.compile(step, backend="eager")
    cd = _ListCache()
    for x in xs:
        d(x, cd)
    frames = counters["frames"]["ok"]
    dynamo.reset()
    assert counter.entries <= frames, (counter.entries, frames)
