"""ember.config: knobs read by the C core when it compiles (not on every call).

Attributes (ints unless stated):
  cache_size_limit     cache entries of a code object made for the objects its locals hold by
                       identity (a module's `self`) before ember stops compiling it for them and
                       runs it eagerly, with one warning naming the guard that failed (torch.compile's
                       torch._dynamo.config.cache_size_limit / recompile_limit, also 8, counted the
                       same way: a model's twelve blocks share their forward's code, one entry each).
  accumulated_cache_size_limit  cache entries of a code object in all (Dynamo's
                       accumulated_recompile_limit, also 256).
  max_inline_depth     nested function/module calls the tracer inlines before it gives up (64:
                       transformers 5.2x reaches 33 levels in a forward, through its wrappers,
                       config __getattribute__ methods and per-layer config views).
  max_loop_iterations  loop iterations the tracer unrolls in one frame before it gives up.
  max_instructions     bytecode instructions the tracer interprets in one frame before it gives up.
  graph_breaks         1 (default): a frame the tracer cannot capture whole is split at the break
                       (graph, the breaking instruction in Python, a compiled resume function);
                       0: it runs as ordinary Python (the foundation's behaviour).

Dynamic shapes (read when a frame is traced):
  sym_shape_rules      1 (default): an op with symbolic sizes gets its output sizes from ember's C
                       shape rules (csrc/trace/em_trace_shape.c) when it has one, else from a
                       fake-tensor run in torch; 0: always the fake-tensor run (tests compare both).

Tracing:
  meta_memo            bool, default True: the tracer and the graph passes infer each distinct torch
                       call on meta tensors once per process (csrc/ir/em_ir_memo.c; FakeTensorMode's
                       dispatch cache in spirit), so repeated layers cost one meta call. ember.reset()
                       keeps it (facts about torch, not code: torch._dynamo.reset() keeps
                       FakeTensorMode's cache too); ember._C._meta_memo(True) clears it. False:
                       every call runs torch's meta kernels (tests compare).

Training (backends "aot_eager" and "ember"; read when a graph is compiled):
  activation_memory_budget  float in [0, 1] (Inductor's torch._functorch.config option of the same
                       name): 1.0 (default) is the min-cut that recomputes only cheap pointwise ops
                       and views; below 1, when that cut saves more than budget x the bytes of saving
                       every value the backward reads, the cut is taken again with every
                       deterministic forward op recomputable (matmul, convolution ...).
  fallback_random      bool (torch._inductor.config.fallback_random, also False by default). False:
                       backend "ember" draws training dropout masks with Philox counter-based random
                       numbers inside its generated kernels (core/em_philox.h): a seed per dropout
                       from torch's generator of the device (so torch.manual_seed makes runs
                       repeatable), the mask drawn again from the seed in the backward instead of
                       saved; the same distribution as eager, not eager's draws. True: eager's own
                       draws (torch.bernoulli / native_dropout), bitwise eager's masks, the mask
                       saved for the backward. "aot_eager" always draws as eager does.

  decompose_layer_norm bool or None, default None: backend "ember" writes a training graph's
                       F.layer_norm as its pieces (mean, variance, rsqrt, affine in float32, as
                       aten's kernel computes it), which autograd differentiates and the code
                       generators fuse with the residual add before it and the gradient after it
                       (csrc/passes/em_pass_decompose.c). None: for CUDA inputs (a CUDA row kernel
                       stores the statistics the backward needs with its output; the C generator
                       does not, so CPU graphs keep aten's native_layer_norm). True: every training
                       graph of backend "ember"; False: never (aten's kernels, e.g. to compare).

  optimize_ddp         bool, default True (torch._dynamo.config.optimize_ddp's "ddp_optimizer"): a
                       training graph compiled inside DistributedDataParallel's forward is split at
                       DDP's gradient buckets (its bucket_bytes_cap; the first bucket at torch's
                       first-bucket size), each piece a region of its own, so that a bucket's
                       gradients are complete, and its all-reduce starts, while the backward of the
                       earlier layers still runs (docs/distributed.md). False: one region; every
                       all-reduce waits for the whole backward.

Backend "ember" (str or None; read when a graph is compiled):
  cc                   the C compiler (None: $CC, else "cc"), found on PATH.
  cflags               its flags; the cache key includes them. -ffp-contract=off: no a * b + c
                       contracted into one fused multiply-add (gcc's default outside ISO C mode),
                       so pointwise arithmetic rounds after every op as eager's kernels do
                       (x * y + 1 bitwise eager's; with contraction 23% of elements differed by
                       an ulp). -mprefer-vector-width=512: gcc's -march=native tuning for
                       AVX-512 Xeons prefers 256-bit vectors; ATen's kernels use 512-bit ones
                       (softmax over (4096, 1024) on the GPU machine's 16-core host: 0.383 ->
                       0.253 ms; a CPU without AVX-512 ignores it).
  ldflags              libraries, after the source file (glibc's libmvec serves the vectorized
                       expf, cosf ... that gcc calls from simd loops).
  huge_pages           bool, default True: before a CPU kernel writes an output of 4 MiB or more,
                       its 2 MiB-aligned part is advised MADV_HUGEPAGE (Linux transparent huge
                       pages; a no-op where they are off), so that the first write takes one page
                       fault per 2 MiB instead of per 4 KiB (what torch's THP_MEM_ALLOC_ENABLE=1
                       does for all its CPU allocations). The 16M-element pointwise chain on the
                       dev VM: 30 ms -> 10 ms, most of it page faults (docs/backend_cpu.md).
  layout_optimization  bool, default True (torch._inductor.config.layout_optimization): in a static
                       inference graph, the inputs of 2-d convolutions of contiguous float32 CPU
                       tensors or bfloat16 / float16 CUDA tensors are converted to channels_last and
                       what follows keeps that layout (oneDNN's faster path; cuDNN's NHWC kernels
                       without transposes; Inductor does the same); outputs keep eager's strides
                       (docs/backend_cpu.md, "channels_last"; docs/backend_cuda.md).
  compile_threads      int or None (torch._inductor.config.compile_threads): the threads that
                       compile one graph's CUDA kernels, as that many NVRTC programs at once (about
                       4 kernels each, the prelude repeated in each; csrc/runtime/em_runtime_cuda.c).
                       None: the CPUs this process may run on, at most 32. The H100 host (16 CPUs):
                       the transformer's 86-kernel backward 4.5 s as one program, 0.6 s as 16.
  emulate_precision_casts
                       bool, default False (torch._inductor.config.emulate_precision_casts): in
                       CUDA kernels, a chain of bfloat16 ops is computed in float32 in registers and
                       rounded to bfloat16 once, where it is stored (and at explicit casts), as
                       Inductor computes it; True rounds every op's result to bfloat16, as eager's
                       op-by-op kernels do (GPT-2's tanh GELU on the H200: 37 us a layer rounding
                       each of its eight ops, against Inductor's 16). Values differ from eager's by
                       bfloat16 rounding either way (eager itself rounds where torch.compile does
                       not). float16 always rounds every op (an overflow to inf happens where
                       eager's does), and the CPU backend always rounds (docs/backend_cpu.md).
  cublaslt_gemm        bool, default True: a CUDA program's matrix products (torch.mm, torch.addmm,
                       torch.matmul of a 2-d right operand, F.linear: extern kernels) are called
                       through cuBLASLt from C (ember._C.Gemm, csrc/runtime/em_runtime_gemm.c): the
                       algorithm chosen once per problem and kept, bias by cuBLASLt's epilogue, torch's
                       math-mode flags read on every call; any call it cannot take exactly is torch's.
                       Host time per bf16 GEMM on the H200 host: torch's 19-25 us against ~16, 12.6 of
                       them cublasLtMatmul's own (bench/README.md, "GEMMs through cuBLASLt from C").
                       False: torch's functions (to compare; a change applies to graphs compiled after it).
                       cache_info(fn)[i]["ember"]["gemm"] names the calls; ember._C._gemm_stats() counts.
  cache_dir            the on-disk kernel cache (None: $EMBER_CACHE_DIR, else $XDG_CACHE_HOME/ember
                       or ~/.cache/ember), created mode 0700.
"""


class Config:
    __slots__ = ("cache_size_limit", "accumulated_cache_size_limit", "max_inline_depth", "max_loop_iterations",
                 "max_instructions", "graph_breaks", "cc", "cflags", "ldflags", "cache_dir", "activation_memory_budget", "sym_shape_rules",
                 "fallback_random", "huge_pages", "layout_optimization", "meta_memo", "compile_threads", "optimize_ddp",
                 "emulate_precision_casts", "decompose_layer_norm", "cublaslt_gemm")

    def __init__(self):
        self.cache_size_limit = 8
        self.accumulated_cache_size_limit = 256
        self.max_inline_depth = 64
        self.max_loop_iterations = 10000
        self.max_instructions = 1000000
        self.graph_breaks = 1
        self.cc = None
        self.cflags = ("-O3 -march=native -mprefer-vector-width=512 -fopenmp -fno-math-errno -fno-trapping-math "
                       "-ffp-contract=off -fwrapv -shared -fPIC")
        self.ldflags = "-lmvec -lm"
        self.cache_dir = None
        self.activation_memory_budget = 1.0
        self.sym_shape_rules = 1
        self.fallback_random = False
        self.huge_pages = True
        self.layout_optimization = True
        self.meta_memo = True
        self.compile_threads = None
        self.optimize_ddp = True
        self.emulate_precision_casts = False
        self.decompose_layer_norm = None
        self.cublaslt_gemm = True

    def __repr__(self):
        fields = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__)
        return f"ember.config({fields})"


config = Config()
