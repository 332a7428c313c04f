"""``python -m megatron_refit.demo``: the command-line entry point of :mod:`megatron_refit.tools.demo`
(the tooling lives in :mod:`megatron_refit.tools`; the runtime imports none of it)."""

from megatron_refit.tools.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
