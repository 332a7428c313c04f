"""``python -m megatron_refit.costmodel``: the command-line entry point of :mod:`megatron_refit.tools.costmodel`
(the tooling lives in :mod:`megatron_refit.tools`; the runtime imports none of it)."""

from megatron_refit.tools.costmodel import main

if __name__ == "__main__":
    raise SystemExit(main())
