"""A rank of tests/py/test_distributed.py: DistributedDataParallel training on the CPU (gloo), eager
and compiled by ember in both wrapping orders; what each scenario ends with is saved for rank 0's
file, which the test reads. Not a test module itself (spawned by torch.multiprocessing)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import ember

D = 64  # a layer's parameters: 64 * 64 * 4 + 64 * 4 bytes, 16.6 KB
CAP_MB = 0.01  # a bucket per layer (10.5 KB: a bucket closes once it holds its cap)


class MLP(nn.Module):
    def __init__(self, unused=False, inplace=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(D, D) for _ in range(4))
        self.unused = nn.Linear(D, D) if unused else None
        self.inplace = inplace  # ReLU(inplace=True), as torchvision's ResNet: functionalized updates

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu_(layer(x)) if self.inplace else torch.relu(layer(x))
        return x


class Block(nn.Module):
    """The unit FSDP2 shards: user code, so the frame hook compiles its forward between FSDP's hooks."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x):
        return torch.relu(self.lin(x)) * 0.5 + x


class BlockMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def make(kind, unused=False, inplace=False, **ddp_kw):
    """(module to call, the DDP instance, the plain model) for kind eager / ddp_of_compiled / compiled_ddp."""
    torch.manual_seed(0)
    m = MLP(unused, inplace)
    if kind == "eager":
        d = DDP(m, bucket_cap_mb=CAP_MB, **ddp_kw)
        return d, d, m
    if kind == "ddp_of_compiled":
        d = DDP(ember.compile(m, backend=os.environ.get("EMBER_DDP_BACKEND", "ember")), bucket_cap_mb=CAP_MB, **ddp_kw)
        return d, d, m
    d = DDP(m, bucket_cap_mb=CAP_MB, **ddp_kw)
    return ember.compile(d, backend=os.environ.get("EMBER_DDP_BACKEND", "ember")), d, m


def batch(rank, step, ragged=False):
    """Rank and step's inputs; ragged: a batch size of its own per rank and step, so the ranks trace
    and compile different graphs (static sizes, then symbolic ones) while DDP reduces in step."""
    g = torch.Generator().manual_seed(100 * rank + step)
    n = 3 + 2 * rank + step if ragged else 8
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def train(kind, rank, steps=4, hook=None, no_sync=False, ragged=False, **ddp_kw):
    """Parameters after `steps` SGD steps, and the last step's order of events: each bucket's comm
    hook call, and the input's gradient (computed when the backward has gone through every layer).
    EMBER_DDP_BACKEND picks the compiled kinds' backend (default "ember")."""
    call, d, m = make(kind, **ddp_kw)
    events = []

    def recording(state, bucket):
        events.append(f"bucket {bucket.index()}")
        return (hook or default_hooks.allreduce_hook)(state, bucket)

    d.register_comm_hook(None, recording)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(steps):
        events.clear()
        x, y = batch(rank, step, ragged)
        x.requires_grad_(True)
        x.register_hook(lambda g: events.append("input grad"))
        opt.zero_grad()
        if no_sync:
            with d.no_sync():
                ((call(x) - y) ** 2).mean().backward()
            x2, y2 = batch(rank, step + 50)
            ((call(x2) - y2) ** 2).mean().backward()
        else:
            ((call(x) - y) ** 2).mean().backward()
        opt.step()
    params = [p.detach().clone() for p in m.parameters()]
    info = ember.cache_info(call if kind == "compiled_ddp" else m) if kind != "eager" else []
    return params, list(events), info


def unused_error(kind, rank):
    """The error of a second step with a parameter no output depends on and find_unused_parameters
    off (DDP's reducer raises it at the next forward), or None."""
    call, d, m = make(kind, unused=True)
    try:
        for step in range(2):
            x, y = batch(rank, step)
            ((call(x) - y) ** 2).mean().backward()
    except RuntimeError as e:
        return type(e).__name__ + ": " + (str(e).splitlines() or [""])[0]
    return None


def swapped_parameter_error(kind, rank):
    """A parameter replaced after DDP wrapped the model (DDP's reducer keeps the old one, which no
    longer gets a gradient): DDP's error at the next step, or None. ember's guards see the new
    parameter and compile again; the error is DDP's, as in eager."""
    call, d, m = make(kind)
    try:
        for step in range(3):
            x, y = batch(rank, step)
            ((call(x) - y) ** 2).mean().backward()
            if step == 0:
                m.layers[-1].weight = torch.nn.Parameter(m.layers[-1].weight.detach() * 2)
    except RuntimeError as e:
        return type(e).__name__ + ": " + (str(e).splitlines() or [""])[0]
    return None


def collective(rank):
    """dist.all_reduce in compiled functions: on a value made in the graph, on an input (updated in
    place, as eager), and with async_op=True (a Work handle: a graph break, run as Python);
    dist.all_gather_into_tensor and dist.reduce_scatter_tensor into a tensor made in the graph; the
    other dist.* collectives, in groups made by dist.new_group too, and funcol's called directly.
    Results (or the error raised) and inputs as eager's; each function's entries (kind, ops or the
    break's reason)."""
    def f(x):
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    def on_input(x):
        dist.all_reduce(x, group=None)
        return x * 3

    def asynchronous(x):
        y = x * 2
        dist.all_reduce(y, async_op=True).wait()
        return y + 1

    def with_op(x, op=dist.ReduceOp.MAX):
        y = x * 2
        dist.all_reduce(y, op)
        return y + 1

    ws = dist.get_world_size()

    def gather(x):
        out = torch.empty(x.numel() * ws)
        dist.all_gather_into_tensor(out, x * 2)
        return out + 1

    def scatter(x, op=dist.ReduceOp.SUM):  # (dist.ReduceOp.SUM read inside: a graph break, its metaclass)
        out = torch.empty(x.numel() // ws)
        dist.reduce_scatter_tensor(out, x * 2, op=op)
        return out + 1

    def broadcast(x):  # rank 1's values on every rank, into an input updated in place
        dist.broadcast(x, 1)
        return x * 2

    def broadcast_made(x):
        y = x + 1
        dist.broadcast(y, src=0, group=None)
        return y * 3

    def world(x):  # read at trace time: constants in the graph, as Dynamo folds them
        return x * dist.get_world_size() + dist.get_rank(group=None)

    def group_src(x):  # broadcast by group rank (rank 0's x)
        dist.broadcast(x, group_src=0)
        return x + 1

    def all_to_all(x):  # even splits: each rank's halves exchanged
        out = torch.empty(x.numel())
        dist.all_to_all_single(out, x * 2)
        return out + 1

    def all_to_all_splits(x, s=[1, 3] if rank == 0 else [3, 1]):  # noqa: B006 (guarded by value)
        out = torch.empty(x.numel())
        dist.all_to_all_single(out, x + torch.arange(4.0), output_split_sizes=s, input_split_sizes=s)
        return out

    def gather_list(x):  # the list form: one gather into a buffer, each entry copied its slice
        outs = [torch.zeros(4) for _ in range(ws)]
        dist.all_gather(outs, x * 2)
        return torch.stack(outs) + 1

    def scatter_list(x):  # the list form: the pieces concatenated, one reduce_scatter_tensor
        out = torch.empty(2)
        dist.reduce_scatter(out, [x[:2] * 2, x[2:] + 1])
        return out * 3

    def all_to_all_list(x):  # rank 0 gets each rank's first halves, rank 1 the second halves
        outs = [torch.zeros(2) for _ in range(ws)]
        dist.all_to_all(outs, [x[:2] * 2, x[2:] + torch.arange(2.0)])
        return torch.cat(outs) + 1

    def all_to_all_uneven(x):  # entries of different sizes: NCCL takes them, gloo raises; a graph break
        outs = [torch.zeros(1 if rank == 0 else 3) for _ in range(ws)]
        dist.all_to_all(outs, [x[:1] * 2, x[1:] + torch.arange(3.0)])
        return torch.cat(outs) + 1

    def all_to_all_async(x):  # a Work handle: a graph break
        outs = [torch.zeros(2) for _ in range(ws)]
        dist.all_to_all(outs, [x[:2] * 2, x[2:] * 3], async_op=True).wait()
        return torch.cat(outs) + 1

    # groups made by dist.new_group (every rank makes each): both ranks, and rank 1 alone (rank 0
    # gets dist.GroupMember.NON_GROUP_MEMBER, an int)
    g01, g1 = dist.new_group([0, 1]), dist.new_group([1])

    def in_group(x, group=g01):  # a ProcessGroup, guarded by identity; each collective in it
        y = x * 2
        dist.all_reduce(y, group=group)
        outs = [torch.empty(4) for _ in range(ws)]
        dist.all_gather(outs, x + y, group=group)
        z = torch.empty(2)
        dist.reduce_scatter(z, [outs[0][:2], outs[1][2:]], group=group)
        dist.broadcast(z, 1, group=group)
        w = torch.empty(4)
        dist.all_to_all_single(w, y + x, group=group)
        v = [torch.empty(2) for _ in range(ws)]
        dist.all_to_all(v, [w[:2], w[2:] * 2], group=group)
        return torch.cat([z, w, *outs, *v]) + dist.get_world_size(group) * 10 + dist.get_rank(group)

    def broadcast_alone(x, group=g1):  # rank 1: from global rank 1, group rank 0; rank 0: not in it
        y = x * 2
        dist.broadcast(y, 1, group=group)
        return y + 1

    def broadcast_outside(x, group=g1):  # global rank 0 is not in the group: eager raises
        dist.broadcast(x, 0, group=group)
        return x + 1

    import torch.distributed._functional_collectives as funcol

    def funcol_calls(x, pg=dist.group.WORLD, name=dist.group.WORLD.group_name,
                     s=[1, 3] if rank == 0 else [3, 1]):  # noqa: B006 (guarded by value)
        a = funcol.all_gather_tensor(x * 2, 0, pg)
        b = funcol.all_gather_single(x.view(2, 2) + torch.arange(4.0).view(2, 2), 1, name)
        c = funcol.reduce_scatter_tensor(a + 1, "SUM", 0, pg)
        d = funcol.reduce_scatter_single(b, "sum", 1, pg, tag="")
        e = funcol.all_to_all_single(x + torch.arange(4.0), s, s, group=g01)
        f = funcol.broadcast(x + 1, 1, pg)
        return torch.cat([a, b.flatten(), c, d.flatten(), e, f, funcol.all_to_all_single(x * 3, None, None, pg)])

    def funcol_ranks(x):  # a group as a list of ranks (guarded by value): the group registered under them
        waited = funcol.wait_tensor(funcol.all_reduce(x + 1, "sum", [0, 1]))  # wait_tensor called directly too
        return torch.cat([funcol.all_gather_tensor(x * 2, 0, [0, 1]) + 1, waited, funcol.wait_tensor(x)])

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,))
    mesh2 = init_device_mesh("cpu", (1, 2))

    def funcol_mesh(x, mesh=mesh):  # a 1-d DeviceMesh (guarded by identity), and (mesh, dim)
        a = funcol.all_reduce(x * 3, "sum", mesh)
        b = funcol.all_gather_tensor(x + 2, 0, mesh)
        c = funcol.all_gather_tensor(x - 1, 0, (mesh2, 1))
        return torch.cat([a, b, c])

    def funcol_autograd(x, pg=dist.group.WORLD):  # the *_autograd forms with no gradient: their plain forms
        a = funcol.all_gather_tensor_autograd(x * 2, 0, pg)
        b = funcol.reduce_scatter_tensor_autograd(a + 1, "sum", 0, pg)
        return torch.cat([a, b, funcol.all_to_all_single_autograd(x * 3, None, None, pg)])

    wg = torch.full((4,), 2.0, requires_grad=True)

    def funcol_autograd_grad(x, w=wg):  # a gradient flows through it: a break (its backward is not traced)
        return torch.cat([funcol.all_gather_tensor_autograd(x * w, 0, dist.group.WORLD)]).detach()

    def funcol_mesh_2d(x):  # a 2-d mesh without a dim: eager raises, a graph break
        return funcol.all_reduce(x * 3, "sum", mesh2)

    def funcol_no_group(x):  # ranks no group was made for: eager raises, a graph break
        return funcol.all_reduce(x * 3, "sum", [1, 0, 1])

    def outcome(call, x):  # the result, or the error eager raises
        try:
            return call(x)
        except Exception as e:  # noqa: BLE001
            return type(e).__name__ + ": " + (str(e).splitlines() or [""])[0]

    out = {}
    for fn in (f, on_input, asynchronous, with_op, gather, scatter, broadcast, broadcast_made, world, group_src,
               all_to_all, all_to_all_splits, gather_list, scatter_list, all_to_all_list, all_to_all_uneven,
               all_to_all_async, in_group, broadcast_alone, broadcast_outside, funcol_calls, funcol_ranks,
               funcol_mesh, funcol_mesh_2d, funcol_no_group, funcol_autograd, funcol_autograd_grad):
        ember.reset()
        x = torch.full((4,), float(rank + 1))
        xe = x.clone()
        c = ember.compile(fn)
        got = [outcome(c, x) for _ in range(2)]
        want = [outcome(fn, xe) for _ in range(2)]
        entries = [(e["kind"], e.get("ops") if e["kind"] == "graph" else e.get("detail"),
                    (e.get("ember") or {}).get("fallback") if isinstance(e.get("ember"), dict) else None)
                   for e in ember.cache_info(c)]
        out[fn.__name__] = (got, want, x, xe, entries)
    return out


def fsdp2(mode, rank, mp=False):
    """Parameters (gathered) after 3 SGD steps of an MLP whose layers and root are fully_shard-ed
    (FSDP2), eager / the root module compiled / each layer compiled (torch's recommended pattern),
    and the graphs ember made."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    m = BlockMLP()
    # the CPU mesh of the gloo group: without one, fully_shard takes the accelerator's device type
    # when the machine has one, and shards the parameters onto a GPU while the inputs stay here
    kw = {"mesh": init_device_mesh("cpu", (dist.get_world_size(),))}
    if mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in m.layers:
        fully_shard(layer, **kw)
    fully_shard(m, **kw)
    call = m
    if mode == "root":
        call = ember.compile(m)
    elif mode == "layers":
        for i, layer in enumerate(m.layers):
            m.layers[i] = ember.compile(layer)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for step in range(3):
        x, y = batch(rank, step)
        opt.zero_grad()
        ((call(x).float() - y) ** 2).mean().backward()
        opt.step()
    graphs = sum(e["kind"] == "graph" for e in ember.cache_info(Block.forward)) if mode != "eager" else 0
    return [p.full_tensor().detach().clone() for p in m.parameters()], graphs


def functional_collective(rank):
    """funcol.all_reduce in a compiled function, the group a ProcessGroup or its name: results, eager's,
    and each entry's ops (one graph each, the collective and its wait inside)."""
    import torch.distributed._functional_collectives as funcol

    def f(x, group):
        y = funcol.all_reduce(x * 2, "sum", group)
        return torch.relu(y) + 1

    pg = dist.distributed_c10d._get_default_group()
    x = torch.full((4,), float(rank + 1))
    c = ember.compile(f)
    got = [c(x, pg), c(x, pg), c(x, pg.group_name)]
    return got, f(x, pg), [(e["kind"], e.get("ops")) for e in ember.cache_info(c)]


def summary(info):
    """(graphs, steps of the first graph's region, its DDP bucket bytes) from cache_info."""
    graphs = [e for e in info if e["kind"] == "graph"]
    ag = graphs[0].get("autograd") or {} if graphs else {}
    return len(graphs), len(ag.get("steps") or ()), ag.get("ddp_bucket_bytes")


def run(rank, world, port, out):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    ember.config.fallback_random = True
    res = {}
    try:
        for kind in ("eager", "ddp_of_compiled", "compiled_ddp"):
            for name, kw in (("plain", {}), ("no_sync", {"no_sync": True}), ("unused", {"unused": True, "find_unused_parameters": True}),
                             ("static_view", {"static_graph": True, "gradient_as_bucket_view": True}),
                             ("fp16_hook", {"hook": default_hooks.fp16_compress_hook}), ("inplace", {"inplace": True}),
                             ("ragged", {"ragged": True})):
                ember.reset()
                params, events, info = train(kind, rank, **kw)
                res[kind, name] = {"params": params, "events": events, "summary": summary(info)}
            ember.reset()
            res[kind, "unused_error"] = unused_error(kind, rank)
            ember.reset()
            res[kind, "swapped_error"] = swapped_parameter_error(kind, rank)
        ember.reset()
        res["collective"] = collective(rank)
        ember.reset()
        res["functional_collective"] = functional_collective(rank)
        for mp in (False, True):
            for mode in ("eager", "root", "layers"):
                ember.reset()
                res["fsdp2", mode, mp] = fsdp2(mode, rank, mp)
    finally:
        dist.destroy_process_group()
    torch.save(res, os.path.join(out, f"rank{rank}.pt"))
