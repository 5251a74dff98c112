"""Drop-in adapters that put aiospec in place of a serving engine's own output path.

``aiospec.integrations.fastdeploy``: FastDeploy's save-output ops (producer side) and the
buffers its ``TokenProcessor`` reads (reading side). Importing an adapter imports no framework
and no GPU module; the tensors it is given decide what it touches.
"""

from __future__ import annotations

__all__: tuple[str, ...] = ()
