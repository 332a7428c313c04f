"""Tiny Megatron models built through Bridge for the tests, the demo and the dry run (on CPU and
on the meta device). Off the runtime path: nothing under ``conversion`` or ``megatron_refit``
outside the tools imports it."""
