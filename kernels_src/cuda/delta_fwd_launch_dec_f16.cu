// Decode kernels for any K <= 128 and V (delta_decode_kernel<..., FIX=0, ...>) and the decode dispatch, f16 state
// storage (see delta_fwd_launch.cuh).
#define KDA_DEFINE_LAUNCH_DEC
#include "delta_fwd_launch.cuh"

KDA_INSTANTIATE_LAUNCH_DEC(__half)
