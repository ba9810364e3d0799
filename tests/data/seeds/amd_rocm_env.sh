# Runtime variables of verl's ROCm setup notes ("Getting started with AMD (ROCM Kernel)").
# Ray's ROCm visibility flag depends on the Ray version:
# For ray >= 2.45.0
export RAY_EXPERIMENTAL_NOSET_HIP_VISIBLE_DEVICES=1
# For ray < 2.45.0
export RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES=1
export HIP_FORCE_DEV_KERNARG=1
export HSA_NO_SCRATCH_RECLAIM=1
export HIPCC_COMPILE_FLAGS_APPEND="--offload-arch=gfx942"
export AMDGPU_TARGETS=gfx942
export ROCM_ARCH=gfx942
export PYTORCH_ROCM_ARCH="gfx90a;gfx942"
export NCCL_MIN_NCHANNELS=112
