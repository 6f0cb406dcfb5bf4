"""Gradient aggregators for multi-task training (`compile(task_balancing=...)`).

One file per aggregator; each is a small class over the `K x K` Gramian of
the task rows (`weights = f(J J^T)`, gradient `weights^T J`), with its pure
weight function next to it (`pcgrad_weights`, `mgda_weights`, ...).
`gramian.py` holds the shared linear-algebra helpers and `qp.py` the exact
small-QP solvers.
"""

from keras_tapeops.aggregation.aligned_mtl import AlignedMTL
from keras_tapeops.aggregation.base import Aggregator
from keras_tapeops.aggregation.cagrad import CAGrad
from keras_tapeops.aggregation.imtlg import IMTLG
from keras_tapeops.aggregation.mgda import MGDA
from keras_tapeops.aggregation.pcgrad import PCGrad
from keras_tapeops.aggregation.upgrad import UPGrad

__all__ = ["Aggregator", "AlignedMTL", "CAGrad", "IMTLG", "MGDA", "PCGrad", "UPGrad"]
