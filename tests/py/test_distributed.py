"""DistributedDataParallel with ember (issue 42), two CPU processes over gloo: both wrapping orders,
DDP(ember.compile(m)) and ember.compile(DDP(m)), train to the parameters eager DDP reaches, with
no_sync, find_unused_parameters, static_graph + gradient_as_bucket_view and a compression comm
hook; the compiled region is split at DDP's buckets, so a bucket's all-reduce starts before the
backward reaches the first layer, as in eager DDP (torch._dynamo's DDPOptimizer). The ranks run
once per module (tests/py/_ddp_worker.py); each test reads what they saved."""
import os
import socket
import sys
import time

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import _ddp_worker  # noqa: E402

KINDS = ("ddp_of_compiled", "compiled_ddp")
SCENARIOS = ("plain", "no_sync", "unused", "static_view", "fp16_hook", "inplace", "ragged")  # ragged: the ranks' graphs differ


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of 2 ranks saved (tests/py/_ddp_worker.py run), within 240 s."""
    import torch.multiprocessing as mp

    out = str(tmp_path_factory.mktemp("ddp"))
    ctx = mp.start_processes(_ddp_worker.run, args=(2, _free_port(), out), nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the DDP ranks did not finish within 240 s")
    return [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("kind", KINDS)
def test_parameters_equal_eager_ddp(ranks, kind, scenario):
    for res in ranks:
        want, got = res["eager", scenario]["params"], res[kind, scenario]["params"]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    # the ranks agree with each other (the gradients were all-reduced)
    for g0, g1 in zip(ranks[0][kind, scenario]["params"], ranks[1][kind, scenario]["params"]):
        torch.testing.assert_close(g0, g1, rtol=0, atol=0)


@pytest.mark.parametrize("scenario", ["plain", "inplace"])  # inplace: functionalized relu_ updates
@pytest.mark.parametrize("kind", KINDS)
def test_one_graph_split_at_ddp_buckets(ranks, kind, scenario):
    graphs, steps, bucket_bytes = ranks[0][kind, scenario]["summary"]
    assert graphs == 1
    # 4 layers of 16.6 KB, a 10.5 KB cap: a region per layer, as DDP buckets them
    assert steps == 4 and len(bucket_bytes) == 4, (steps, bucket_bytes)
    assert all(b == 64 * 64 * 4 + 64 * 4 for b in bucket_bytes[1:]), bucket_bytes
    assert bucket_bytes[0] == 64 * 64 * 4 + 64 * 4 + 8 * 64 * 4  # the first layer's, and the input's


@pytest.mark.parametrize("kind", KINDS + ("eager",))
def test_buckets_reduce_while_the_backward_runs(ranks, kind):
    """Eager DDP's order: the last layers' buckets call their comm hook before the backward has
    computed the input's gradient; a compiled model that is one backward region would call them all
    after it."""
    events = ranks[0][kind, "plain"]["events"]
    assert "input grad" in events
    before = events[: events.index("input grad")]
    assert len(before) >= 2, events  # of 4


@pytest.mark.parametrize("kind", KINDS)
def test_unused_parameters_without_find_unused_raise_as_eager(ranks, kind):
    want = ranks[0]["eager", "unused_error"]
    assert want and "RuntimeError" in want
    assert ranks[0][kind, "unused_error"] == want


@pytest.mark.parametrize("kind", KINDS)
def test_a_parameter_replaced_after_wrapping_raises_as_eager(ranks, kind):
    want = ranks[0]["eager", "swapped_error"]
    assert want and "RuntimeError" in want
    assert ranks[0][kind, "swapped_error"] == want


def test_dist_all_reduce_is_traced_into_the_graph(ranks):
    """dist.all_reduce(y) updates y in place and returns None: traced as Dynamo rewrites it,
    torch.ops._c10d_functional.all_reduce, its wait_tensor and y.copy_(result), in program order
    (never run on real tensors at trace time: every rank must make the same calls; the copy into a
    value made in the graph is functional, so that graph is ember's kernels); one graph, on a
    value made in the graph, on an input (updated in place, as eager), with ReduceOp.MAX (a default
    argument: guarded by identity). async_op=True returns a
    Work handle: a graph break, run as Python. dist.all_gather_into_tensor and
    dist.reduce_scatter_tensor are traced the same way (funcol's all_gather_tensor_inplace and
    reduce_scatter_tensor_inplace), dist.broadcast (in the default group; by group_src: a graph
    break), dist.all_to_all_single (even splits, and constant lists of split sizes) dist.all_gather
    into a list and dist.reduce_scatter of a list (funcol's all_gather_inplace, reduce_scatter_inplace). dist.get_world_size() and dist.get_rank() are read at trace time, as Dynamo folds them.
    Results and inputs as eager's on every rank."""
    for res in ranks:
        out = res["collective"]
        for name, (got, want, x, xe, entries) in out.items():
            for g, w in zip(got, want):  # a tensor, or the error eager raises
                assert g == w if isinstance(w, str) else torch.equal(g, w), (name, g, w)
            assert torch.equal(x, xe), name
        assert torch.equal(out["f"][1][0], torch.full((4,), 7.0))  # (1 + 2) * 2 + 1
        assert torch.equal(out["with_op"][1][0], torch.full((4,), 5.0))  # max(1, 2) * 2 + 1
        for name in ("f", "on_input", "with_op"):
            (kind, ops, fallback), = out[name][4]
            assert kind == "graph", out[name][4]
            assert ops.index("torch.ops._c10d_functional.all_reduce") < ops.index(
                "torch.ops._c10d_functional.wait_tensor") < ops.index("copy_"), ops
            if name != "on_input":  # the copy into a value made in the graph is functional: ember's kernels
                assert not fallback, fallback
        assert any(k == "break" and "torch.distributed calls run as Python" in (d or "") for k, d, _ in out["asynchronous"][4])
        # all_gather_into_tensor / reduce_scatter_tensor (2 ranks, x = rank + 1): one graph each
        assert torch.equal(out["gather"][1][0], torch.tensor([3.0] * 4 + [5.0] * 4))  # (1 | 2) * 2 + 1
        assert torch.equal(out["scatter"][1][0], torch.full((2,), 7.0))  # (1 + 2) * 2 + 1
        for name, op in (("gather", "all_gather_into_tensor"), ("scatter", "reduce_scatter_tensor"),
                         ("broadcast", "broadcast"), ("broadcast_made", "broadcast"),
                         ("all_to_all", "all_to_all_single"), ("all_to_all_splits", "all_to_all_single"),
                         ("gather_list", "all_gather_into_tensor"), ("scatter_list", "reduce_scatter_tensor")):
            (kind, ops, fallback), = out[name][4]
            assert kind == "graph", out[name][4]
            assert ops.index(f"torch.ops._c10d_functional.{op}") < ops.index(
                "torch.ops._c10d_functional.wait_tensor") < ops.index("copy_"), ops
            if name != "broadcast":  # the copy into an input is the torch op (an input updated in place)
                assert not fallback, out[name][4]
        # broadcast: rank 1's x (2.0) everywhere, the input updated on rank 0 as eager updates it
        assert torch.equal(out["broadcast"][0][0], torch.full((4,), 4.0))
        assert torch.equal(out["broadcast"][2], torch.full((4,), 2.0))
        assert torch.equal(out["broadcast_made"][0][0], torch.full((4,), 6.0))  # rank 0's x + 1, times 3
        (kind, ops, _), = out["world"][4]  # x * 2 + rank: no collective, the sizes baked in
        assert kind == "graph" and not any("distributed" in o or "c10d" in o for o in ops), ops
        (kind, ops, _), = out["group_src"][4]  # broadcast by group rank: rank 0's x, plus 1
        assert kind == "graph" and "torch.ops._c10d_functional.broadcast" in ops, ops
        assert torch.equal(out["group_src"][0][0], torch.full((4,), 2.0))
    for res in ranks:  # dist.all_gather into a list: each rank's x * 2 + 1
        assert torch.equal(res["collective"]["gather_list"][0][0], torch.tensor([[3.0] * 4, [5.0] * 4]))
    # dist.reduce_scatter of a list (x = rank + 1): rank 0 gets (1 + 2) * 2 * 3, rank 1 (2 + 3) * 3
    assert torch.equal(ranks[0]["collective"]["scatter_list"][0][0], torch.full((2,), 18.0))
    assert torch.equal(ranks[1]["collective"]["scatter_list"][0][0], torch.full((2,), 15.0))
    # all_to_all_single (x = rank + 1): rank 0 gets both ranks' first halves, rank 1 the second halves
    r0, r1 = ranks[0]["collective"], ranks[1]["collective"]
    assert torch.equal(r0["all_to_all"][0][0], torch.tensor([3.0, 3.0, 5.0, 5.0]))
    assert torch.equal(r1["all_to_all"][0][0], torch.tensor([3.0, 3.0, 5.0, 5.0]))
    # uneven splits [1, 3] / [3, 1]: rank 0 gets 1 element of its own and 3 of rank 1's
    assert torch.equal(r0["all_to_all_splits"][0][0], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(r1["all_to_all_splits"][0][0], torch.tensor([2.0, 3.0, 4.0, 5.0]))


def _collectives(ops):
    """The functional collectives among a graph's ops, in program order (their waits left out)."""
    pre = "torch.ops._c10d_functional."
    return [o[len(pre):] for o in ops if o.startswith(pre) and o != pre + "wait_tensor"]


def test_all_to_all_lists_groups_and_functional_calls_are_traced(ranks):
    """dist.all_to_all of lists (which Dynamo breaks on): torch.cat of the inputs, one functional
    all_to_all_single split evenly, its wait, each output's copy_ of its slice; entries of different
    sizes break (gloo's alltoall raises, as it does here, compiled or not). Groups made by
    dist.new_group, passed as group= (a ProcessGroup guarded by identity): every collective form in
    one graph, in program order, with dist.get_world_size(group) / get_rank(group) folded; a
    broadcast's global src turned into the group rank (rank 1 alone in a group broadcasts from group
    rank 0); a src outside the group (eager raises) and a rank outside it (eager's call does
    nothing) break. funcol's
    all_gather_tensor / all_gather_single (along dims 0 and 1), reduce_scatter_tensor /
    reduce_scatter_single, all_to_all_single (even and uneven splits, another group) and broadcast
    called directly: one graph; funcol's group given as a list of ranks (the group registered under
    them), a 1-d DeviceMesh or (mesh, dim), and funcol.wait_tensor called on a result or on any
    tensor (the tensor itself): one graph; funcol's *_autograd forms where no gradient flows (their
    plain forms): one graph, and where one flows: a break; a 2-d mesh without a dim and ranks no group
    was made for (eager raises) break. Results (or errors) as eager's
    on every rank (checked for every function by the test above)."""
    r0, r1 = ranks[0]["collective"], ranks[1]["collective"]
    for res in (r0, r1):
        graph = {}
        for name in ("all_to_all_list", "in_group", "funcol_calls"):
            (kind, ops, fallback), = res[name][4]
            assert kind == "graph" and not fallback, (name, res[name][4])
            graph[name] = ops
        ops = graph["all_to_all_list"]
        assert _collectives(ops) == ["all_to_all_single"], ops
        assert ops.index("torch.cat") < ops.index("torch.ops._c10d_functional.all_to_all_single") < ops.index(
            "torch.ops._c10d_functional.wait_tensor") < ops.index("narrow") < ops.index("copy_"), ops
        assert _collectives(graph["in_group"]) == ["all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                                                   "broadcast", "all_to_all_single", "all_to_all_single"]
        assert _collectives(graph["funcol_calls"]) == ["all_gather_into_tensor"] * 2 + ["reduce_scatter_tensor"] * 2 + [
            "all_to_all_single", "broadcast", "all_to_all_single"]
        for name in ("all_to_all_uneven", "all_to_all_async", "broadcast_outside", "funcol_mesh_2d", "funcol_no_group"):
            assert [k for k, _, _ in res[name][4]] == ["break"], (name, res[name][4])
        for name in ("funcol_mesh_2d", "funcol_no_group"):  # eager raises, and so does the compiled call
            assert "torch.distributed calls run as Python" in res[name][4][0][1]
            assert all(isinstance(g, str) for g in res[name][0]), res[name][0]
        # funcol's group as a rank list, a 1-d DeviceMesh, (mesh, dim): one graph, the collectives in it
        (kind, ops, fallback), = res["funcol_autograd"][4]  # no gradient flows: the plain forms, one graph
        assert kind == "graph" and _collectives(ops) == ["all_gather_into_tensor", "reduce_scatter_tensor",
                                                         "all_to_all_single"], res["funcol_autograd"][4]
        assert "break" in [k for k, _, _ in res["funcol_autograd_grad"][4]], res["funcol_autograd_grad"][4]
        for name, want in (("funcol_ranks", ["all_reduce", "all_gather_into_tensor"]),  # wait_tensor: no new op
                           ("funcol_mesh", ["all_reduce", "all_gather_into_tensor", "all_gather_into_tensor"])):
            (kind, ops, fallback), = res[name][4]
            assert kind == "graph" and not fallback, (name, res[name][4])
            assert _collectives(ops) == want, (name, ops)
        # x = rank + 1 on each rank: gathers of both ranks' values, sums of both
        x = 1.0 if res is r0 else 2.0  # this rank's input, returned by wait_tensor(x)
        assert torch.equal(res["funcol_ranks"][0][0], torch.tensor([3.0] * 4 + [5.0] * 4 + [5.0] * 4 + [x] * 4))
        assert torch.equal(res["funcol_mesh"][0][0], torch.tensor([9.0] * 4 + [3.0] * 4 + [4.0] * 4 + [0.0] * 4 + [1.0] * 4))
        for name in ("all_to_all_uneven", "broadcast_outside"):  # eager raises, and so does the compiled call
            assert all(isinstance(g, str) for g in res[name][0]), res[name][0]
        assert "invalid tensor size" in res["all_to_all_uneven"][0][0]
    # all_to_all of lists (x = rank + 1): rank 0 gets both ranks' first halves (times 2), rank 1 the
    # second halves (plus [0, 1]), each plus 1
    assert torch.equal(r0["all_to_all_list"][0][0], torch.tensor([3.0, 3.0, 5.0, 5.0]))
    assert torch.equal(r1["all_to_all_list"][0][0], torch.tensor([2.0, 3.0, 3.0, 4.0]))
    # in_group: all_reduce of 2x (6), the gather of x + 6 ([7, 8]), their reduce-scatter (rank 0:
    # 7 + 7, rank 1: 8 + 8) broadcast from rank 1 (16), the exchange of x + 6 and of its halves
    # (times 2 for the second), plus the group's size * 10 and the rank
    want = torch.tensor([16.0, 16, 7, 7, 8, 8, 7, 7, 7, 7, 8, 8, 8, 8])
    assert torch.equal(r0["in_group"][0][0], torch.cat([want, torch.tensor([7.0, 7, 7, 7])]) + 20)
    assert torch.equal(r1["in_group"][0][0], torch.cat([want, torch.tensor([16.0, 16, 16, 16])]) + 21)
    # broadcast in the group of rank 1 alone: a graph there; on rank 0, outside it, a break, and the
    # call does nothing, as eager's (x * 2 + 1)
    (kind, ops, _), = r1["broadcast_alone"][4]
    assert kind == "graph" and _collectives(ops) == ["broadcast"], ops
    assert torch.equal(r1["broadcast_alone"][0][0], torch.full((4,), 5.0))
    assert [k for k, _, _ in r0["broadcast_alone"][4]] == ["break"]
    assert torch.equal(r0["broadcast_alone"][0][0], torch.full((4,), 3.0))


@pytest.mark.parametrize("mp", [False, True], ids=["fp32", "bf16_params"])
@pytest.mark.parametrize("mode", ["root", "layers"])
def test_fsdp2_equals_eager_fsdp2(ranks, mode, mp):
    """FSDP2 (fully_shard per layer and at the root), the root compiled or each layer compiled, with
    and without a MixedPrecisionPolicy: the gathered parameters after 3 steps are eager FSDP2's.
    FSDP's pre- and post-forward hooks (the all-gathers, the reduce-scatter hooks) run as Python at
    the modules' boundaries, so each layer's forward is a graph of its own."""
    for res in ranks:
        want, _ = res["fsdp2", "eager", mp]
        got, graphs = res["fsdp2", mode, mp]
        assert graphs >= 1
        tol = {"rtol": 1e-2, "atol": 1e-3} if mp else {"rtol": 1e-5, "atol": 1e-6}
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **tol)


def test_functional_all_reduce_is_an_extern_call_in_the_graph(ranks):
    """funcol.all_reduce(t, "sum", group) is traced into the graph as
    torch.ops._c10d_functional.all_reduce and its wait_tensor (one graph per group form: a
    ProcessGroup guarded by identity, or its name by value), with eager's result on every rank."""
    for res in ranks:
        got, want, entries = res["functional_collective"]
        assert torch.equal(want, torch.full((4,), 7.0))
        for g in got:
            assert torch.equal(g, want)
        assert [k for k, _ in entries] == ["graph", "graph"], entries
        for _, ops in entries:
            assert "torch.ops._c10d_functional.all_reduce" in ops and "torch.ops._c10d_functional.wait_tensor" in ops
