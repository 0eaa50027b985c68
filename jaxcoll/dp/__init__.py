"""jaxcoll.dp: data-parallel training (DDP for JAX) on jaxcoll's collectives, flax and optax.

Needs the ``dp`` extra (flax, optax, orbax-checkpoint, tqdm, grain): ``pip install jaxcoll[dp]``.
The gradient-sync strategy is a value (:mod:`jaxcoll.dp.sync`):
``dp.Trainer(loss_fn, optimizer, sync=dp.sync.FSDP())``; communication hooks are in
:mod:`jaxcoll.dp.hooks`. The model's own mesh axes (tensor, pipeline) are a
:class:`~jaxcoll.dp.Layout`: ``dp.Trainer(..., layout=dp.Layout(tensor="tensor"))``.
"""

from . import hooks as hooks
from . import sync as sync
from .adapters import Linen as Linen
from .adapters import Model as Model
from .adapters import Nnx as Nnx
from .adapters import building as building
from .batchnorm import SyncBatchNorm as SyncBatchNorm
from .callbacks import Action as Action
from .callbacks import Callback as Callback
from .callbacks import EarlyStopping as EarlyStopping
from .callbacks import JsonlWriter as JsonlWriter
from .callbacks import SaveBest as SaveBest
from .checkpoint.checkpointer import Checkpointer as Checkpointer
from .data.batches import Batches as Batches
from .data.grain import TokenBatches as TokenBatches
from .data.grain import TokenWindows as TokenWindows
from .extra import Extra as Extra
from .extra import ema as ema
from .layout import BoundLayout as BoundLayout
from .layout import Layout as Layout
from .loop.components import Profile as Profile
from .loop.components import Progress as Progress
from .loop.components import Throughput as Throughput
from .loop.evaluate import Evaluate as Evaluate
from .reports.metrics import measure_peak_flops as measure_peak_flops
from .reports.plot import PlotWriter as PlotWriter
from .reports.plot import plot_history as plot_history
from .reports.plot import plot_trace as plot_trace
from .reports.tensorboard import TensorBoardWriter as TensorBoardWriter
from .reports.tensorboard import read_scalars as read_scalars
from .state import TrainState as TrainState
from .survivor import Survivor as Survivor
from .sync.buckets import mean_gradients as mean_gradients
from .sync.buckets import plan_buckets as plan_buckets
from .sync.quantized import Quantize as Quantize
from .trainer import Trainer as Trainer

__all__ = [
    "Action",
    "Batches",
    "BoundLayout",
    "Callback",
    "Checkpointer",
    "EarlyStopping",
    "Evaluate",
    "Extra",
    "JsonlWriter",
    "Layout",
    "Linen",
    "Model",
    "Nnx",
    "building",
    "PlotWriter",
    "Profile",
    "Progress",
    "Quantize",
    "SaveBest",
    "Survivor",
    "SyncBatchNorm",
    "TensorBoardWriter",
    "Throughput",
    "TokenBatches",
    "TokenWindows",
    "Trainer",
    "TrainState",
    "ema",
    "hooks",
    "mean_gradients",
    "measure_peak_flops",
    "plan_buckets",
    "plot_history",
    "plot_trace",
    "read_scalars",
    "sync",
]
