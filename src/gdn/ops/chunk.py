"""chunk_gated_delta_rule: placeholder until the chunked kernels land (issue 3)."""


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False, *, state_layout="v_last",
                           ssm_state_indices=None, chunk_size=64):
    raise NotImplementedError("chunk_gated_delta_rule is not implemented yet")
