"""`python -m jdp.export --workdir W --out params.npz` (the command is `jdp.cli.export`), and the function
`jdp.export(workdir, path)` (`jdp.reopen.export`)."""

import sys
import types

from jdp import reopen


class _CallableModule(types.ModuleType):
    """`jdp.export` names both this command's module and the function `jdp.export(workdir, path)`: once the
    module is imported it is the package's attribute, so the module itself calls `jdp.reopen.export`."""

    def __call__(self, *args: object, **kwargs: object) -> tuple[int, int]:
        return reopen.export(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    from jdp.cli.export import main

    sys.exit(main())
