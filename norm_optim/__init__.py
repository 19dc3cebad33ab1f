"""norm_optim: exact, cheap global weight norms for Megatron-core optimizers.

Wrap the optimizer once; ask for the norm at log intervals::

    from norm_optim import NormAwareOptimizer
    optimizer = NormAwareOptimizer(get_megatron_optimizer(config, model_chunks), model=model_chunks)
    norm = optimizer.param_l2_norm()   # float(norm) is the global L2 norm of the weights
"""

from .comm import Communicator, TorchCommunicator
from .errors import NormOptimError, ParallelStateError, UnknownParamError, UnsupportedOptimizerError
from .norm import NamedNorms, ParamNorms, PendingNorms
from .ownership import RankCoords
from .registry import ParamRecord, ParamRegistry
from .vocabulary import NotCounted, Source
from .wrapper import NormAwareOptimizer

__all__ = [
    "Communicator",
    "NamedNorms",
    "NormAwareOptimizer",
    "NotCounted",
    "NormOptimError",
    "ParallelStateError",
    "ParamNorms",
    "ParamRecord",
    "ParamRegistry",
    "PendingNorms",
    "RankCoords",
    "Source",
    "TorchCommunicator",
    "UnknownParamError",
    "UnsupportedOptimizerError",
]

__version__ = "0.2.0"
