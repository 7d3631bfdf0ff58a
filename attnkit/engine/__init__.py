"""From a spec to an executor: :mod:`.plan` (which tiles hold work), :mod:`.autograd` (the one
autograd node, forward and hand-written backward) and :mod:`.ops` (the ``torch.library``
custom ops ``torch.compile`` sees), and :mod:`.compile_cache` (torch's compile cache under
``ATEN_CPU_CAPABILITY``). The executors themselves are in :mod:`attnkit.backends`.
"""
