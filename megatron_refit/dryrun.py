"""``python -m megatron_refit.dryrun``: the command-line entry point of :mod:`megatron_refit.tools.dryrun`
(the tooling lives in :mod:`megatron_refit.tools`; the runtime imports none of it)."""

from megatron_refit.tools.dryrun import main

if __name__ == "__main__":
    raise SystemExit(main())
