"""The engines a refit lands in: each in its own folder (``hf``, ``vllm``, ``sglang``) with its
storage, post-load step, control client and entry point; ``registry`` names them and says
what each offers, ``base`` is the control protocol every engine is driven through."""
