// Copyright (c) 2024, Jay Shah, Ganesh Bikshandi, Ying Zhang, Vijay Thakkar, Pradeep Ramani, Tri Dao.
// Trimmed for kvbench from `run_mha_fwd_hdim128`: bf16, head dim 128, causal, K/V of
// fixed length (no block table, no split, no local window, so no cluster either).

#include "flash_fwd_launch_template.h"

void run_mha_fwd_hdim128_bf16_causal(Flash_fwd_params &params, cudaStream_t stream) {
    using T = cutlass::bfloat16_t;
    constexpr static int Headdim = 128;
    MMA_2WG_SWITCH(params.seqlen_q, kNumMmaWGs, [&] {
        run_flash_fwd<
            Flash_fwd_kernel_traits<Headdim, kNumMmaWGs * 64, 128, 4 + kNumMmaWGs * 4, 2, false, 1, T, false>,
            /*Is_causal=*/true,
            /*Is_local=*/false,
            flash::FixedSeqLenTraits,
            flash::FixedSeqLenTraits
        >(params, stream);
    });
}
