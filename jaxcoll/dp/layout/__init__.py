"""dp.Layout: every role of the mesh in one value, its short name, and the layout bound to one
mesh (:class:`BoundLayout`, what a Trainer keeps).

* :mod:`._layout`: :class:`Layout`;
* :mod:`._bound`: :class:`BoundLayout` (:meth:`Layout.bind`), the checks against the mesh;
* :mod:`._grammar`: the short name (``"fsdp2xtp2xpp2:1f1b8"``) printed and parsed;
* :mod:`._split`: :class:`BatchSplit`, how the batch reaches each device.
"""

from ._bound import DEFAULT_DATA_AXIS as DEFAULT_DATA_AXIS
from ._bound import BoundLayout as BoundLayout
from ._grammar import ABBREVIATIONS as ABBREVIATIONS
from ._grammar import GRAMMAR as GRAMMAR
from ._grammar import SINGLE as SINGLE
from ._layout import ROLES as ROLES
from ._layout import Layout as Layout
from ._layout import is_spec as is_spec
from ._split import BatchSplit as BatchSplit
