"""The docs' snippets' imports from the Megatron-Bridge side (``conversion``) exist (the rest:
tests/unit/test_doc_snippets.py, which owns the reading of the docs). Checked in a rank forked
from the tier's forkserver, which has Bridge imported already (this process would import it
for this test alone: about 20 s of CPU)."""

from megatron_refit.local.launch import run_spawned
from tests.unit.test_doc_snippets import MEGATRON_SIDE, doc_import_problems


def _problems(rank, world_size, port):
    return doc_import_problems(MEGATRON_SIDE)


def test_every_name_a_doc_snippet_imports_from_the_megatron_side_exists():
    problems = run_spawned(_problems, 1, timeout_s=300)[0]
    assert not problems, "the docs import what does not exist:\n" + "\n".join(problems)
