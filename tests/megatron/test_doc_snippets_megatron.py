"""The docs' snippets' imports from the Megatron-Bridge side (``conversion``) exist (the rest:
tests/unit/test_doc_snippets.py, which owns the reading of the docs)."""

from tests.unit.test_doc_snippets import MEGATRON_SIDE, doc_import_problems


def test_every_name_a_doc_snippet_imports_from_the_megatron_side_exists():
    problems = doc_import_problems(MEGATRON_SIDE)
    assert not problems, "the docs import what does not exist:\n" + "\n".join(problems)
