"""Every error type the runtime raises on purpose, in one place (docs/troubleshooting.md has
a row for each message). Imports nothing but ``re``: every layer raises them.

- the plan: :class:`PlanError` (``prepare()``: train and engine pieces do not match);
- the transport: :class:`RefitTransportError`, :class:`RefitTimeoutError`,
  :class:`RefitProtocolError`, :class:`WireError`;
- the endpoints: :class:`RefitAbortedError`, :class:`ReplicaFailedError`, :class:`RefitCorruptionError`,
  :class:`StaleWeightsError`, :class:`NonFiniteWeightsError`;
- the engines' control calls: :class:`EngineLoadError`;
- proof of serving (``refit.verify_serving``): :class:`ServingMismatchError`;
- the tools' ranks spawned on one host (tests, the demo, the benchmarks): :class:`SpawnError`,
  which the command-line tools read to report a rank's bad input in one line.

Bad arguments and config values are plain ``ValueError``s naming the value.
"""

import re


class RefitTransportError(RuntimeError):
    """A transfer failed: the peer closed the connection, crashed or misbehaved; or the
    group could not be formed, or is broken by an earlier failure."""


class RefitTimeoutError(RefitTransportError):
    """A wait ran past ``timeout_s``."""


class RefitProtocolError(RuntimeError):
    """Refit ranks are in different calls (or run different protocol versions): raised on
    every rank of the exchange, naming each side's call; no weight byte moved."""


class PlanError(ValueError):
    """The train and gen ShardSpecs cannot be matched; the message names the parameter."""


class WireError(ValueError):
    """Bytes from a peer that are not refit metadata."""


class RefitAbortedError(RuntimeError):
    """Another refit rank failed its own checks at the start of a refit; nothing moved."""


class ReplicaFailedError(RefitAbortedError):
    """Train side, ``refit.on_replica_failure: raise`` (or no replica landed the refit): an engine
    replica could not apply it (its engine raised, its bytes were corrupted); names each failed
    replica and why. Every other replica holds the version; the failed ones are stale until
    their next refit, which brings them back (a full one where their storage may be written).
    ``report``: the refit's report, where one was made (``failed_ranks``: each rank's error)."""

    def __init__(self, message: str, report=None):
        super().__init__(message)
        self.report = report


class EngineLoadError(RuntimeError):
    """Train rank 0: an engine replica's group carried a refit, but its engine's control call
    (receiving, or making the version live: vLLM's ``finish_weight_update``, SGLang's resume)
    failed or did not return in ``refit.timeout_s``. That replica alone failed the refit."""


class RefitCorruptionError(ValueError):
    """A bucket's digest did not match (``verify``): its bytes changed in flight, or it was
    delivered to the wrong place or version. Names the parameters."""


class RepackedParameterError(ValueError):
    """Engine side, ``engine_load: in_place``: an engine parameter is not in the checkpoint
    layout (a post-load step re-packed it), so a refit cannot write it in place; the engine
    loads through its own loaders instead (``engine_load: load_weights``, or ``auto``)."""


class StaleWeightsError(RuntimeError):
    """The engine's weights are not those of a complete refit."""


class NonFiniteWeightsError(ValueError):
    """``check_finite``: a trainer piece holds NaN or Inf; nothing was sent."""


class ServingMismatchError(RuntimeError):
    """``refit.verify_serving``: an engine replica landed a version's bytes, but what it serves
    is not the trainer's model: its per-token log-probs on the probe differ from the trainer's
    own forward at that version by more than the tolerance (an engine's post-load step changed
    the model, or it could not score the probe). That replica has not landed the version; it is
    handled as any replica failure (``refit.on_replica_failure``) and its next refit is a full one.
    ``replica``, ``version``, ``max_dlogprob`` and ``first`` (``(sequence, token)``, or None) say
    where."""

    def __init__(self, message: str, *, replica: int, version: int, max_dlogprob: float,
                 first: tuple[int, int] | None):
        super().__init__(message)
        self.replica, self.version = replica, version
        self.max_dlogprob, self.first = max_dlogprob, first


class SpawnError(RuntimeError):
    """A spawned rank failed, died, or the group ran past its timeout
    (:func:`megatron_refit.local.launch.run_spawned`)."""

    @property
    def innermost(self) -> tuple[str, str] | None:
        """``(exception class name, message)`` of the failed rank's innermost error, read from
        the traceback this error carries; None if it carries none (a death, a timeout)."""
        lines = [line for line in str(self).splitlines() if line.strip()]
        match = re.match(r"([A-Za-z_][\w.]*): (.*)", lines[-1]) if len(lines) > 1 else None
        return (match.group(1).rsplit(".", 1)[-1], match.group(2)) if match else None
