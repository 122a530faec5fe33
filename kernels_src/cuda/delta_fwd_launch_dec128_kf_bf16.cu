// Decode kernels for K = V = 128 (delta_decode_kernel<..., FIX=128, ...>, delta_recurrent_fwd.cuh), bf16 state
// storage, K-first layout (see delta_fwd_launch.cuh).
#define KDA_DEFINE_LAUNCH_DEC_FIXED
#include "delta_fwd_launch.cuh"

KDA_INSTANTIATE_LAUNCH_DEC_FIXED(false, __nv_bfloat16)
