"""Time and memory of ``NormAwareOptimizer.param_l2_norm()`` next to the alternatives.

Every method runs on the **same** model, optimizer and parallel layout, in the same processes,
interleaved call by call (so machine noise hits them alike):

=================  ==============================================================================
``norm_optim``     ``NormAwareOptimizer.param_l2_norm()``.
``floor``          one fused sum of squares over exactly the fp32 tensors this rank counts (a list
                   built once), one all-reduce, a square root: the least any implementation can do.
``attribute_walk`` what Megatron-LM's ``calc_params_l2_norm`` does today: walk every model param on
                   each call, read ``main_param`` / ``main_param_sharded``, sum each bucket (dense /
                   expert x sharded / whole), reduce the sharded buckets over DP x CP (dense) and
                   expert-DP (expert), then over the model-parallel groups, and ``.item()``.
``fp32_copy``      Megatron-LM's fallback (``force_create_fp32_copy=True``, and its expert path
                   before #2249): ``.float()`` of every local param, then the same reductions.
``dtensor_walk``   Megatron-FSDP cases (``fsdp-*``) only, in place of the two walks: what
                   ``calc_params_l2_norm`` does under ``--use-megatron-fsdp``
                   (``stop_communication``, the model's DTensors grouped by spec, one all-reduce
                   per sharded mesh dim of each spec, ``.item()``). Under EP it misses the
                   other EP ranks' experts.
``fsdp2_walk``     torch FSDP2 cases (``fsdp2-*``, megatron's ``TorchFullyShardedDataParallel``):
                   ``calc_params_l2_norm`` as it runs there (0.19): ``to_local()`` of each DTensor
                   drops ``main_param``, so an fp32 copy of the local bf16 shard, never summed over
                   DP (about 1/sqrt(DP) of the norm).
``get_total_norm`` torch FSDP2 cases: ``torch.nn.utils.get_total_norm`` over the fp32 DTensors the
                   optimizer steps (what a torch-native user calls); DTensor's reductions are
                   functional collectives, which the collective count does not see.
=================  ==============================================================================

Per case and method it reports the median seconds per call, the extra peak memory of one call,
the collectives and host syncs of one call, and the relative error against a float64 reference.

Usage, from the repository root (CPU, gloo ranks forked by :func:`norm_optim.testing.run_ranks`)::

    python -m benchmarks.param_norm --quick                     # < 3 min on 2 cores
    python -m benchmarks.param_norm --json benchmarks/results/cpu-DATE.json \\
        --plot-dir benchmarks/results

On CUDA (NCCL), launch one process per GPU with torchrun; every model runs at the launched world::

    torchrun --nproc-per-node 4 -m benchmarks.param_norm --device cuda --json cuda-4.json
    torchrun --nproc-per-node 1 -m benchmarks.param_norm --device cuda --json cuda-1.json

``--replot JSON...`` redraws the plots from earlier results without running anything.

Modules, in the order a run uses them: ``cases`` (the models and layouts), ``bench`` (one case
built on a rank), ``methods`` (the norms compared), ``reference`` (the float64 norm they are
checked against), ``events`` / ``memory`` / ``measure`` (what one call costs, merged over
ranks), ``runners`` (forked ranks or torchrun), ``report`` / ``plots`` (table, targets, JSON,
PNGs), ``__main__`` (the command line).
"""
