"""The GPU check: norm_optim's CUDA path measured in one run, printed as one table.

``python -m benchmarks.gpu_check`` (``make gpu-check``) on a machine with one CUDA GPU, in
under 5 minutes. Each row of the table is one measurement:

===============  ==================================================================================
``peak``         a device-to-device copy (read + write bytes over its time): the practical ceiling
                 of a kernel that reads each byte once, measured in the same run; the ``of peak``
                 column of every kernel row is relative to it.
``kernel``       the sum of squares of a tensor list (one tensor, or one buffer split into
                 ``K`` tensors: ``--sizes 1e8x1000``), bf16 and fp32, 10⁶ to 10⁹ elements (capped
                 by free GPU memory), by ``torch._foreach_norm``, norm_optim's own path
                 (:class:`norm_optim._kernels.SumOfSquaresPlan`, the backend it picked in the
                 note), apex's ``multi_tensor_l2norm`` and Transformer Engine's (each skipped, with
                 the reason, where it does not import). Median time of several calls (CUDA
                 events, after warm-up, L2 flushed before each), achieved GB/s (bytes read once
                 over that time) and its fraction of ``peak``, the relative error of the norm
                 against a float64 reference of the same values, and the extra peak GPU memory
                 of one call (``torch.cuda.max_memory_allocated`` above what was allocated).
``nccl``         ``init_process_group("nccl")`` at world size 1 (a FileStore), then a small
                 ``all_reduce``: median time, and whether the sum came back unchanged.
``megatron``     ``NormAwareOptimizer.param_l2_norm()`` on a real megatron-core optimizer on CUDA
                 (a GPT built with :mod:`norm_optim.testing`'s pieces, weights set by
                 :func:`~norm_optim.testing.fill_deterministic_`; the Float16 and the distributed
                 optimizer), against the float64 oracle of those weights
                 (:func:`~norm_optim.testing.oracle_norm`); next to it Megatron-LM's own
                 ``megatron.training.utils.calc_params_l2_norm`` (as is and with
                 ``force_create_fp32_copy=True``; skipped where ``megatron.training`` does not
                 import) and a naive ``[p.float() for p in params]`` norm: time to a host float,
                 relative error and extra peak GPU memory of one call. Then an armed ``step()``
                 (``measure_next_step()`` + ``step()`` + ``step_norms()``) against a plain one on
                 the same grads: its time and the ratio, the aten ops it adds per param tensor
                 (each a kernel launch), its extra ``max_memory_allocated``, the grads' total
                 against the grad norm ``step()`` returns; and ``audit()``: its time, extra
                 memory and verdict. Without megatron-core the row says ``skipped: megatron-core
                 not installed``.
===============  ==================================================================================

Without CUDA it prints one line saying so (and what it would run) and exits 0. ``--device cpu``
runs the same code on CPU (gloo, small sizes) to check the script itself; its numbers mean
nothing.

The table is also written, as text and as JSON (rows and environment), to the folder ``--out``
names (default ``benchmarks/results/``).

Running it on a GPU machine without network access
--------------------------------------------------
Plan for the hardest case: Python 3.12 and torch (CUDA build), no megatron-core, no apex or
Transformer Engine, and no package registry. The script needs no install of norm_optim: run from the repository root,
``python3 -m benchmarks.gpu_check`` imports the working tree. For the ``megatron`` rows, carry
the megatron-core wheel (it needs only torch, numpy and packaging, which are there), e.g. 0.19.2
(Python >= 3.12). Once, in the repository root of the machine you work on::

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        -d .whl megatron-core==0.19.2

then run, on the GPU machine, with ``.whl`` carried along (one command, well under 5 minutes)::

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit
    PYTHONUNBUFFERED=1 python3 -m benchmarks.gpu_check --out benchmarks/results

(``make gpu-check`` builds the project's virtual environment first, which needs a package
registry: on a machine without network call the module directly.) See ``docs/gpu-check.md``.

Modules, in the order a run uses them: ``measure`` (the options, timing, extra memory, the
float64 reference, the rows), ``kernels`` (the ``peak`` and ``kernel`` rows), ``nccl`` (the
``nccl`` row), ``megatron`` (the ``megatron`` rows), ``report`` (the table, the environment, the
files), ``cli`` (the command line; ``__main__`` runs it).
"""

from .cli import main, parse_args
from .kernels import KernelMethod, copy_peak_row, kernel_methods, kernel_rows, kernel_section
from .measure import (
    Options,
    Row,
    bandwidth_gbs,
    extra_peak_bytes,
    float64_sum_of_squares,
    make_tensors,
    median_seconds,
    median_seconds_to_host,
    parse_size,
    peak_fraction,
    rel_error,
    row,
    skipped,
)
from .megatron import megatron_section, process_group_sections
from .nccl import all_reduce_row, world_of_one
from .report import default_out_dir, format_table, run_environment, write_outputs

__all__ = [
    "KernelMethod",
    "Options",
    "Row",
    "all_reduce_row",
    "bandwidth_gbs",
    "copy_peak_row",
    "default_out_dir",
    "extra_peak_bytes",
    "float64_sum_of_squares",
    "format_table",
    "kernel_methods",
    "kernel_rows",
    "kernel_section",
    "main",
    "make_tensors",
    "median_seconds",
    "median_seconds_to_host",
    "megatron_section",
    "parse_args",
    "parse_size",
    "peak_fraction",
    "process_group_sections",
    "rel_error",
    "row",
    "run_environment",
    "skipped",
    "world_of_one",
    "write_outputs",
]
