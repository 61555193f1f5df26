"""The stream's default decode path: compiled where it pays, the compile kept on disk and reused by later runs.

A stream that is not told how to decode (``StreamSession(compile=None)``, ``stream_generate``, ``ChatStream``,
``sinklab stream`` / ``sinklab chat`` without ``--compile`` or ``--eager``) asks :func:`resolve_compile`:

* ``$SINKLAB_COMPILE`` (:data:`COMPILE_ENV`) ``0``/``off`` — eager; ``1``/``on`` — compiled; ``auto`` or unset —
  :func:`compile_pays`: compiled on a CPU for float32, bfloat16 or float16 weights (:data:`CPU_COMPILE_DTYPES`) of
  a model of at least :data:`MIN_PARAMETERS` when inductor can build its C++ kernels (a C++ compiler and Python's
  headers), the cases measured faster than eager (docs/stream.md); eager elsewhere.
* ``compile=False`` (``--eager``) is eager and ``compile=True`` or a dict of options compiles, whatever the variable.

On a CPU sinklab's own compile also passes :func:`matvec_options`: each one-token product of a row by a weight is
inductor's own C++ reduction over the weight's rows instead of a BLAS call. The eager steps read the weights in the
decode layout (:func:`decode_layout`), which a session gives back before its step compiles.

A compiled step keeps inductor's on-disk caches (its FX graph cache and AOTAutograd's cache) under sinklab's cache
folder, ``<cache>/inductor`` (:func:`use_compile_cache`; ``$TORCHINDUCTOR_CACHE_DIR`` if the user set one), so
the compile runs once per model, dtype, torch version and machine; a later process loads the compiled kernels
instead of building them again (dynamo still traces the forward in each new process). :class:`FirstCall`
announces the first compiled call on stderr and says how long it took and whether the cache served it.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path

import torch

from .compile import frozen
from .errors import InputError
from .gguf import cache_root

__all__ = ["COMPILE_ENV", "CPU_COMPILE_DTYPES", "LAYOUT_ENV", "MATVEC_WIDTH", "FirstCall", "apply_matvec_width", "compile_pays",
           "compiled_step", "decode_layout", "default_compile", "matvec_options", "resolve_compile", "restore_layout",
           "use_compile_cache"]

#: The environment variable that sets the default: ``auto`` (or unset), ``1``/``on``, ``0``/``off``.
COMPILE_ENV = "SINKLAB_COMPILE"
_ON = {"1", "on", "true", "yes"}
_OFF = {"0", "off", "false", "no"}
#: Smallest model the automatic choice compiles: the measured models (SmolLM2-135M, Gemma 3 270M) are above it; a
#: tiny model's eager step is already short, and the compile's wait would never be paid back in a session.
MIN_PARAMETERS = 50_000_000
#: Decode steps an automatic compile runs eagerly first: a run shorter than this never waits for a compile
#: (docs/stream.md has the break-even it comes from).
EAGER_STEPS = 1024
#: The environment variable that turns the decode weight layout off (``0``/``off``): :func:`decode_layout`.
LAYOUT_ENV = "SINKLAB_DECODE_LAYOUT"
#: Inductor's own variable for its cache folder; when set, sinklab leaves the folder to it.
INDUCTOR_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"


def cxx_compiler() -> str | None:
    """The C++ compiler inductor's CPU backend would call (``$CXX``, else ``g++``, ``c++`` or ``clang++``), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def python_headers() -> bool:
    """Whether ``Python.h`` is installed (inductor's CPU kernels are built as Python extension modules)."""
    include = sysconfig.get_paths().get("include")
    return include is not None and (Path(include) / "Python.h").is_file()


#: Weight dtypes the automatic choice compiles on a CPU (each measured faster compiled with :func:`matvec_options`
#: than eager: docs/stream.md, "The matrix-vector products").
CPU_COMPILE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def compile_pays(device: torch.device | str, dtype: torch.dtype, parameters: int = MIN_PARAMETERS) -> bool:
    """The automatic choice: compile on a CPU for float32, bfloat16 or float16 weights
    (:data:`CPU_COMPILE_DTYPES`) of a model of ``parameters`` ≥ :data:`MIN_PARAMETERS` when inductor can build
    there. Other devices and dtypes decode eagerly unless asked (``compile=True``, ``--compile``): their default
    compile is not measured faster here (a GPU's fast step is ``compile={"mode": "reduce-overhead"}``)."""
    return (torch.device(device).type == "cpu" and dtype in CPU_COMPILE_DTYPES and parameters >= MIN_PARAMETERS
            and cxx_compiler() is not None and python_headers())


def default_compile(device: torch.device | str, dtype: torch.dtype, parameters: int = MIN_PARAMETERS) -> bool:
    """Whether a stream told nothing compiles its decode step: ``$SINKLAB_COMPILE``, else :func:`compile_pays`."""
    value = os.environ.get(COMPILE_ENV, "").strip().lower()
    if value in _OFF:
        return False
    if value in _ON:
        return True
    if value not in ("", "auto"):
        raise InputError(f"${COMPILE_ENV} is auto, 1 (on) or 0 (off), got {os.environ[COMPILE_ENV]!r}")
    return compile_pays(device, dtype, parameters)


def _weights(model: torch.nn.Module) -> tuple[torch.device, torch.dtype, int]:
    """Device and dtype of the model's first floating-point parameter (CPU float32 for a model without one), and
    its parameter count."""
    count = sum(p.numel() for p in model.parameters())
    for p in model.parameters():
        if p.is_floating_point():
            return p.device, p.dtype, count
    return torch.device("cpu"), torch.float32, count


def resolve_compile(compile: bool | dict | None, model: torch.nn.Module) -> tuple[bool | dict | None, bool]:
    """``compile`` as given, or (None) the default for ``model``'s weights: ``(compile, automatic)``, where
    ``automatic`` says the choice was sinklab's (a failed automatic compile falls back to eager). sinklab's own
    compile on a CPU is ``{"options": matvec_options()}``; elsewhere ``True``."""
    if compile is not None:
        return compile, False
    device, dtype, count = _weights(model)
    if not default_compile(device, dtype, count):
        return False, True
    return ({"options": matvec_options()} if torch.device(device).type == "cpu" else True), True


#: The widest weight (rows or columns) whose one-row product :func:`matvec_options` decomposes: every projection and
#: LM head of the models sinklab streams.
MATVEC_WIDTH = 1 << 20


def matvec_options() -> dict:
    """Inductor settings for a compiled one-token step on a CPU: each product of one row by a weight (every
    projection, the LM head) is decomposed into a multiply and a sum over the weight's rows, which inductor emits as
    one streaming C++ reduction per weight, instead of calling the BLAS matrix product (docs/stream.md, "The
    matrix-vector products"). The pass is inductor's ``decompose_mm_pass``, its width limit raised to
    :data:`MATVEC_WIDTH` so that the LM head is decomposed too. A plain dict: importing inductor waits for the
    compile (:func:`compiled_step` applies the width, :func:`apply_matvec_width`).
    ``StreamSession(model, compile={"options": matvec_options()})`` asks for it explicitly."""
    return {"post_grad_fusion_options": {"decompose_mm_pass": {"cpu_max_other_dimension_decomposition": MATVEC_WIDTH}}}


def apply_matvec_width(options: dict) -> None:
    """Make the CPU width limit that ``options`` (``torch.compile``'s keyword arguments) give inductor's
    ``decompose_mm_pass`` hold: the pass's module reads that setting once, when it is first imported, so a limit
    given to one compile is otherwise ignored. Raises the module's limit to the one asked for (never lowers it; only
    compiles that turn the pass on read it). Imports inductor: call it when compiling."""
    extra = options.get("options") or {}
    asked = (extra.get("post_grad_fusion_options") or {}).get("decompose_mm_pass", {}).get(
        "cpu_max_other_dimension_decomposition")
    if asked is None:
        return
    import importlib

    try:
        decompose = importlib.import_module("torch._inductor.fx_passes.decompose_mem_bound_mm")
    except ImportError:  # pragma: no cover - a torch without the pass: the option is then ignored
        return
    if getattr(decompose, "cpu_max_other_dimension_decomposition", asked) < asked:
        setattr(decompose, "cpu_max_other_dimension_decomposition", asked)  # noqa: B010


def decode_layout(model: torch.nn.Module) -> int:
    """Store every float32 ``nn.Linear`` weight of ``model`` that sits on the CPU input-major — the same values, the
    same ``[out, in]`` shape, as the transposed view of a contiguous ``[in, out]`` tensor — so that a one-token
    step's ``F.linear`` (``x @ W.T``, ``W.T`` now contiguous) takes the library's faster matrix-vector kernel
    (docs/stream.md measures both layouts). Eager steps gain; a compiled step with :func:`matvec_options` reads the
    weights as stored and is slower on these (a session gives the layout back before it compiles); a prefill chunk and
    transformers' own forward give the same numbers (to float32 rounding). A weight tied to the input embedding
    moves with it. Weights already laid out so, or on another device or dtype, are left as they are;
    ``$SINKLAB_DECODE_LAYOUT=0`` turns it off. Counted per model: every call is matched by one
    :func:`restore_layout` (a :class:`~sinklab.stream.StreamSession` holds one while it decodes eagerly),
    and the last one puts the weights back as they were. Returns the number of weights moved by this call."""
    held = _LAID_OUT.get(model)
    if held is not None:
        held[0] += 1
        return 0
    moved: list[torch.Tensor] = []
    if os.environ.get(LAYOUT_ENV, "").strip().lower() not in _OFF:
        for module in model.modules():
            weight = getattr(module, "weight", None)
            if not isinstance(module, torch.nn.Linear) or not isinstance(weight, torch.Tensor):
                continue
            if weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2 \
                    or min(weight.shape) < 2 or not weight.is_contiguous():
                continue
            with torch.no_grad():
                weight.data = weight.data.t().contiguous().t()
            moved.append(weight)
    _LAID_OUT[model] = [1, moved]
    return len(moved)


def restore_layout(model: torch.nn.Module) -> int:
    """Undo one :func:`decode_layout` of ``model``; the last one stores the weights it moved contiguous again (what
    ``save_pretrained`` and safetensors expect). Returns the number of weights put back (0 while others hold it)."""
    held = _LAID_OUT.get(model)
    if held is None:
        return 0
    held[0] -= 1
    if held[0] > 0:
        return 0
    del _LAID_OUT[model]
    for weight in held[1]:
        with torch.no_grad():
            weight.data = weight.data.contiguous()
    return len(held[1])


#: Models laid out by :func:`decode_layout`: ``[holders, the weights moved]``.
_LAID_OUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def use_compile_cache() -> Path:
    """Point inductor's on-disk caches at ``<sinklab cache>/inductor`` unless ``$TORCHINDUCTOR_CACHE_DIR`` is set,
    and turn on its FX graph cache and AOTAutograd's cache unless their own variables say otherwise. Returns the
    folder. The variable is set in this process's environment (inductor reads it there, as do its workers)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if not os.environ.get(INDUCTOR_DIR_ENV):
        os.environ[INDUCTOR_DIR_ENV] = str(cache_root() / "inductor")
    if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ:
        inductor_config.fx_graph_cache = True
    if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ:
        functorch_config.enable_autograd_cache = True
    return Path(os.environ[INDUCTOR_DIR_ENV])


def _say(text: str) -> None:
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


def _cache_counts() -> tuple[int, int]:
    """Inductor's FX graph cache hits and misses so far in this process."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


class FirstCall:
    """``forward`` with its first call — where ``torch.compile`` compiles — announced and timed on stderr (``say``).

    ``build``: makes the forward at the first call instead (``torch.compile`` imports dynamo and inductor, which
    would otherwise delay the prompt's prefill and so the first token). ``fallback``: an eager forward to run
    instead when that first call fails to compile (an automatic compile: the stream still runs, with a warning);
    None lets the error through (a compile the caller asked for). ``eager_calls``: the first calls run ``fallback``
    instead, so that a short run never waits for a compile it would not earn back."""

    def __init__(self, forward: Callable | None = None, *, build: Callable[[], Callable] | None = None,
                 label: str = "decode step", cache: Path | None = None, fallback: Callable | None = None,
                 say: Callable[[str], None] = _say, quiet: bool = False, eager_calls: int = 0) -> None:
        if (forward is None) == (build is None):
            raise TypeError("FirstCall takes a forward or a build function, one of the two")
        if eager_calls and fallback is None:
            raise TypeError("eager_calls needs a fallback (the eager forward) to run them")
        self.eager_left = eager_calls
        self.forward: Callable | None = forward
        self.build, self.label, self.cache, self.fallback = build, label, cache, fallback
        self.say = (lambda text: None) if quiet else say
        self.pending = True
        self.seconds: float | None = None  # how long the first call took
        self.from_cache: bool | None = None  # whether inductor's cache served it (None: no inductor graph)

    @property
    def runs_eager(self) -> bool:
        """Whether the next call runs the eager forward: an eager call still to come, or a compile that failed."""
        if self.pending:
            return self.eager_left > 0
        return self.fallback is not None and self.forward is self.fallback

    def __call__(self, *args, **kwargs):
        if not self.pending:
            return self.forward(*args, **kwargs)
        if self.eager_left > 0:
            self.eager_left -= 1
            return self.fallback(*args, **kwargs)
        self.pending = False
        where = f" (compile cache: {self.cache})" if self.cache is not None else ""
        self.say(f"\n[sinklab: compiling the {self.label} with torch.compile — once per model, dtype and machine, "
                 f"then loaded from the cache{where}; --eager or compile=False skips it]")
        hits, misses = _cache_counts()
        start = time.perf_counter()
        try:
            if self.forward is None:
                self.forward = self.build()
            out = self.forward(*args, **kwargs)
        except Exception as exc:  # a compile that sinklab chose and that cannot build here: decode eagerly
            if self.fallback is None:
                raise
            warnings.warn(f"the automatic compile of the {self.label} failed ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}); decoding eagerly (set "
                          f"{COMPILE_ENV}=0 or pass compile=False / --eager to skip the attempt)", RuntimeWarning,
                          stacklevel=2)
            self.forward = self.fallback
            return self.forward(*args, **kwargs)
        self.seconds = time.perf_counter() - start
        new_hits, new_misses = _cache_counts()
        self.from_cache = None if (new_hits, new_misses) == (hits, misses) else new_misses == misses
        how = "loaded from the compile cache" if self.from_cache else "compiled"
        self.say(f"[sinklab: {self.label} {how} in {self.seconds:.1f} s]")
        return out


def compiled_step(forward: Callable, options: dict, *, freezing: bool, automatic: bool = False,
                  say: Callable[[str], None] = _say) -> FirstCall:
    """``torch.compile(forward, **options)`` (with inductor's freezing when ``freezing``), its kernels cached under
    :func:`use_compile_cache`'s folder, its first call announced (:class:`FirstCall`); ``automatic``: the compile
    was sinklab's default choice, so the first :data:`EAGER_STEPS` calls run ``forward`` itself and a failure to
    compile falls back to it."""
    inductor = options.get("backend", "inductor") == "inductor"
    cache = use_compile_cache() if inductor else None

    def build() -> Callable:
        apply_matvec_width(options)
        step = torch.compile(forward, **options)
        return frozen(step) if freezing else step
    # A model's forward compiled before in this process: dynamo reuses its graph (a chat's /reset), nothing to say.
    owner = getattr(forward, "__self__", None)
    quiet = owner is not None and owner in _ANNOUNCED
    if owner is not None:
        _ANNOUNCED.add(owner)
    return FirstCall(build=build, cache=cache, fallback=forward if automatic else None, say=say, quiet=quiet,
                     eager_calls=EAGER_STEPS if automatic else 0)


#: The models whose forward :func:`compiled_step` has compiled in this process.
_ANNOUNCED: weakref.WeakSet = weakref.WeakSet()
