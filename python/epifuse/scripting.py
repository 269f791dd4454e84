"""TorchScript: epifuse heads refuse ``torch.jit.script`` with an error that says why.

The fused forward dispatches in Python (device, dtype and shape checks) and
trains through a ``torch.autograd.Function``; TorchScript compiles neither, and
scripting only the reference math would silently drop the fused path. So the
heads raise at ``torch.jit.script`` time instead of deep inside the compiler.
``torch.compile`` (fullgraph) and ``torch.export`` trace the fused ops instead.
"""

from __future__ import annotations

SCRIPT_ERROR = ("{cls} (epifuse) cannot be compiled with torch.jit.script: its forward chooses "
                "between the fused CUDA ops and the reference math in Python and trains through "
                "a torch.autograd.Function, which TorchScript does not support. Use "
                "torch.compile(model) (the fused ops trace under fullgraph=True) or "
                "torch.export.export(model, (x,)) instead.")


class NotScriptable:
    """Mixin for nn.Modules: ``torch.jit.script(module)`` raises a RuntimeError naming the cause.

    ``torch.jit.script`` calls ``__prepare_scriptable__`` on every module it is
    given, before compiling anything; raising there gives one clear message.
    """

    def __prepare_scriptable__(self):
        raise RuntimeError(SCRIPT_ERROR.format(cls=type(self).__name__))
