"""The NeuronCore limits the simulator enforces (Trainium2 / NeuronCore-v3 numbers).

Sources: the NKI docs (nki.language.tile_size, nki.isa.nc_matmul, the Trainium2 architecture guide).
Changing a number here changes what the simulator accepts; tests/test_nki_sim.py checks each one is enforced.
"""
PMAX = 128                       # partitions of SBUF and PSUM; the partition axis of any on-chip tile
SBUF_BYTES_PER_PARTITION = 192 * 1024   # trn2: 24 MiB SBUF / 128 partitions
PSUM_BANKS = 8                   # PSUM banks per partition
PSUM_BANK_BYTES = 2 * 1024       # one bank = 2 KiB per partition = 512 fp32
PSUM_FMAX = PSUM_BANK_BYTES // 4  # 512: the largest free size (fp32 elements) of one PSUM tile
GEMM_STATIONARY_FMAX = 128       # nc_matmul: stationary free size <= 128 (the result's partitions)
GEMM_MOVING_FMAX = 512           # nc_matmul: moving free size <= 512 (the result's free size)
PE_TRANSPOSE_MAX = 128           # nc_transpose on the Tensor Engine: <= 128 x 128
DVE_TRANSPOSE_MAX = 32           # nc_transpose on the Vector Engine: <= 32 x 32
PARTITION_START_ALIGN = 32       # compute instructions start at partition 0, 32, 64 or 96 (conservative rule)
