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
def test_generate_compiles_once_per_phase(make, cache):
    model = make()
    ids = torch.randint(1, 128, (2, 8), generator=torch.Generator().manual_seed(1))
    new = 64 if make is tiny_llama else 24
    ref = generate(model, ids, new, cache)
    orig = model.forward
    model.forward = ember.compile(orig)
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
