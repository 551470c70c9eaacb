// CUDA kernels of the quantized KV cache: quantize-on-write, dequantizing gather, page copies.
//
// The format and the arithmetic follow dyngen_core/storage/qformat.py operation for operation
// (same butterfly order, IEEE division, round-half-even, fp16 scale rounding), so the torch code
// is an exact oracle: tests/gpu/test_native_kernels.py compares them bit for bit.
//
// Quantize and gather use one warp per cached row (token, kv head). Lane l holds element
// 32 * g + l of group g, so the 32-point Hadamard of a group is five __shfl_xor butterflies and
// the group's max is a warp reduction.

#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_fp16.h>
#include <torch/types.h>

#include <cmath>
#include <cstdint>

namespace dyngen {
namespace {

// Rows come in float32, float16 or bfloat16 (never float64).
#define DYNGEN_DISPATCH_ROW_TYPES(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                  \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)    \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)     \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

constexpr int kGroup = 32;
constexpr int kRowsPerBlock = 4;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kFp16Max = 65504.0f;

struct PageRows {
  uint8_t* codes;    // [num_slots, heads, packed_bytes]
  __half* scales;    // [num_slots, heads, head_dim / 32]
  int bits;
};

__device__ __forceinline__ float load_float(const float* p) { return *p; }
__device__ __forceinline__ float load_float(const c10::Half* p) { return static_cast<float>(*p); }
__device__ __forceinline__ float load_float(const c10::BFloat16* p) {
  return static_cast<float>(*p);
}

template <typename T>
__device__ __forceinline__ T store_value(float v) {
  return static_cast<T>(v);
}

// In-place unnormalized Walsh-Hadamard transform of the 32 values held by the warp's lanes:
// pairs at distance h become (a + b, a - b), h = 1, 2, 4, 8, 16, as in hadamard.walsh_hadamard.
__device__ __forceinline__ float warp_hadamard(float v, int lane) {
#pragma unroll
  for (int h = 1; h < kGroup; h <<= 1) {
    const float other = __shfl_xor_sync(kFullMask, v, h);
    v = (lane & h) ? (other - v) : (v + other);
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int h = 16; h > 0; h >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, h));
  return v;
}

// Quantize one rotated group value per lane; returns the signed code, writes the group's scale.
__device__ __forceinline__ int quantize_group(float v, int bits, __half* scale_out, int lane) {
  const float amax = warp_max(fabsf(v));
  const bool positive_extreme = __any_sync(kFullMask, v == amax);
  const float extreme = positive_extreme ? amax : -amax;
  const float lowest = -static_cast<float>(1 << (bits - 1));
  const float highest = static_cast<float>((1 << (bits - 1)) - 1);
  const float scale_f = fminf(fmaxf(__fdiv_rn(extreme, lowest), -kFp16Max), kFp16Max);
  const __half scale16 = __float2half_rn(scale_f);
  const float scale = __half2float(scale16);
  if (lane == 0) *scale_out = scale16;
  if (scale == 0.0f) return 0;
  const float code = fminf(fmaxf(rintf(__fdiv_rn(v, scale)), lowest), highest);
  return static_cast<int>(code);
}

// Pack the warp's 32 codes of group g into the row's code bytes (layout in qformat.py).
__device__ __forceinline__ void store_codes(int code, int bits, uint8_t* row_codes, int g,
                                            int lane) {
  const int element = g * kGroup + lane;
  if (bits == 8) {
    row_codes[element] = static_cast<uint8_t>(static_cast<int8_t>(code));
    return;
  }
  const unsigned u = static_cast<unsigned>(code + (1 << (bits - 1)));
  const unsigned u1 = __shfl_down_sync(kFullMask, u, 1);
  if (bits == 4) {
    if ((lane & 1) == 0) row_codes[element / 2] = static_cast<uint8_t>(u | (u1 << 4));
    return;
  }
  const unsigned u2 = __shfl_down_sync(kFullMask, u, 2);
  const unsigned u3 = __shfl_down_sync(kFullMask, u, 3);
  if ((lane & 3) == 0) {
    const unsigned word = u | (u1 << 6) | (u2 << 12) | (u3 << 18);
    uint8_t* out = row_codes + 3 * (element / 4);
    out[0] = static_cast<uint8_t>(word & 0xffu);
    out[1] = static_cast<uint8_t>((word >> 8) & 0xffu);
    out[2] = static_cast<uint8_t>((word >> 16) & 0xffu);
  }
}

__device__ __forceinline__ int load_code(const uint8_t* row_codes, int bits, int element) {
  if (bits == 8) return static_cast<int>(static_cast<int8_t>(row_codes[element]));
  if (bits == 4) {
    const unsigned byte = row_codes[element / 2];
    return static_cast<int>((element & 1) ? (byte >> 4) : (byte & 0xfu)) - 8;
  }
  const uint8_t* in = row_codes + 3 * (element / 4);
  const unsigned word = in[0] | (static_cast<unsigned>(in[1]) << 8) |
                        (static_cast<unsigned>(in[2]) << 16);
  return static_cast<int>((word >> (6 * (element & 3))) & 0x3fu) - 32;
}

// grid: (ceil(T * heads / 4), 2): blockIdx.y picks keys (0) or values (1).
template <typename scalar_t>
__global__ void quantize_write_kernel(const scalar_t* __restrict__ key,
                                      const scalar_t* __restrict__ value,
                                      const int64_t* __restrict__ slots, PageRows key_pages,
                                      PageRows value_pages, const float* __restrict__ signs,
                                      float inv_sqrt, int64_t num_rows, int heads, int head_dim,
                                      int64_t num_slots) {
  const int lane = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= num_rows) return;
  const int64_t slot = slots[row / heads];
  if (slot < 0 || slot >= num_slots) return;  // padding slots: nothing to store
  const bool is_key = blockIdx.y == 0;
  const scalar_t* in = (is_key ? key : value) + row * head_dim;
  const PageRows pages = is_key ? key_pages : value_pages;
  const int groups = head_dim / kGroup;
  const int64_t dst_row = slot * heads + row % heads;
  uint8_t* row_codes = pages.codes + dst_row * (head_dim * pages.bits / 8);
  __half* row_scales = pages.scales + dst_row * groups;
  const float sign = signs[lane];
  for (int g = 0; g < groups; ++g) {
    float v = load_float(in + g * kGroup + lane) * sign;
    v = warp_hadamard(v, lane) * inv_sqrt;
    const int code = quantize_group(v, pages.bits, row_scales + g, lane);
    store_codes(code, pages.bits, row_codes, g, lane);
  }
}

// One warp per output row of out [B, P * page_size, heads, head_dim].
template <typename out_t>
__global__ void dequantize_gather_kernel(const uint8_t* __restrict__ codes,
                                         const __half* __restrict__ scales,
                                         const int* __restrict__ page_table,
                                         const float* __restrict__ signs, float inv_sqrt,
                                         out_t* __restrict__ out, int bits, int64_t num_rows,
                                         int pages_per_seq, int page_size, int heads,
                                         int head_dim, int num_pages) {
  const int lane = threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.y;
  if (row >= num_rows) return;
  const int head = static_cast<int>(row % heads);
  const int64_t token = row / heads;
  const int offset = static_cast<int>(token % page_size);
  const int64_t table_index = token / page_size;  // b * pages_per_seq + p
  const int page = page_table[table_index];
  out_t* row_out = out + row * head_dim;
  const int groups = head_dim / kGroup;
  if (page < 0 || page >= num_pages) {  // invalid page id: return zeros rather than fault
    for (int g = 0; g < groups; ++g) row_out[g * kGroup + lane] = store_value<out_t>(0.0f);
    return;
  }
  const int64_t src_row = (static_cast<int64_t>(page) * page_size + offset) * heads + head;
  const uint8_t* row_codes = codes + src_row * (head_dim * bits / 8);
  const __half* row_scales = scales + src_row * groups;
  const float sign = signs[lane];
  for (int g = 0; g < groups; ++g) {
    const int element = g * kGroup + lane;
    float v = static_cast<float>(load_code(row_codes, bits, element)) *
              __half2float(row_scales[g]);
    v = warp_hadamard(v, lane) * inv_sqrt * sign;
    row_out[element] = store_value<out_t>(v);
  }
}

// grid: (chunks, tensors, copies). table: [tensors, 3] = (base address, page bytes, slot bytes);
// copies: [copies, 3] = (src page, dst page, slots). Copies of one launch are independent.
__global__ void copy_pages_kernel(const int64_t* __restrict__ table,
                                  const int64_t* __restrict__ copies) {
  const int64_t* t = table + 3 * blockIdx.y;
  const int64_t* c = copies + 3 * blockIdx.z;
  uint8_t* base = reinterpret_cast<uint8_t*>(t[0]);
  const uint8_t* src = base + c[0] * t[1];
  uint8_t* dst = base + c[1] * t[1];
  const int64_t bytes = c[2] * t[2];
  const int64_t start = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const auto alignment = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst) |
                         static_cast<uintptr_t>(bytes);
  if ((alignment & 15u) == 0) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    for (int64_t i = start; i < bytes / 16; i += stride) d[i] = s[i];
  } else if ((alignment & 3u) == 0) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = start; i < bytes / 4; i += stride) d[i] = s[i];
  } else {
    for (int64_t i = start; i < bytes; i += stride) dst[i] = src[i];
  }
}

void check_pages(const at::Tensor& codes, const at::Tensor& scales, int bits, int head_dim) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "bits must be 4, 6 or 8, got ", bits);
  TORCH_CHECK(codes.is_cuda() && codes.is_contiguous(), "codes must be contiguous CUDA");
  TORCH_CHECK(codes.element_size() == 1, "codes must be int8 or uint8");
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              "scales must be contiguous float16");
  TORCH_CHECK(codes.size(-1) == head_dim * bits / 8, "codes last dim ", codes.size(-1),
              " does not match head_dim ", head_dim, " at ", bits, " bits");
  TORCH_CHECK(scales.size(-1) == head_dim / kGroup, "scales last dim must be head_dim / 32");
}

unsigned grid_rows(int64_t rows) {
  return static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock);
}

}  // namespace

void quantize_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                    const at::Tensor& key_codes, const at::Tensor& key_scales,
                    const at::Tensor& value_codes, const at::Tensor& value_scales,
                    const at::Tensor& signs, int64_t key_bits, int64_t value_bits) {
  TORCH_CHECK(key.dim() == 3 && key.sizes() == value.sizes(), "key/value must be [T, H, D]");
  TORCH_CHECK(key.is_contiguous() && value.is_contiguous(), "key/value must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "key/value dtypes differ");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.numel() == key.size(0),
              "slot_mapping must be int64 [T]");
  const int heads = static_cast<int>(key.size(1));
  const int head_dim = static_cast<int>(key.size(2));
  TORCH_CHECK(head_dim % kGroup == 0, "head_dim must be a multiple of 32");
  check_pages(key_codes, key_scales, static_cast<int>(key_bits), head_dim);
  check_pages(value_codes, value_scales, static_cast<int>(value_bits), head_dim);
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.numel() == kGroup, "signs: float32[32]");
  const int64_t num_rows = key.size(0) * heads;
  if (num_rows == 0) return;
  const int64_t num_slots = key_codes.numel() / (heads * key_codes.size(-1));
  const c10::cuda::CUDAGuard guard(key.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const PageRows key_pages{static_cast<uint8_t*>(key_codes.data_ptr()),
                           reinterpret_cast<__half*>(key_scales.data_ptr()),
                           static_cast<int>(key_bits)};
  const PageRows value_pages{static_cast<uint8_t*>(value_codes.data_ptr()),
                             reinterpret_cast<__half*>(value_scales.data_ptr()),
                             static_cast<int>(value_bits)};
  const float inv_sqrt = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kGroup)));
  const dim3 grid(grid_rows(num_rows), 2);
  const dim3 block(kGroup, kRowsPerBlock);
  DYNGEN_DISPATCH_ROW_TYPES(key.scalar_type(), "quantize_write", [&] {
    quantize_write_kernel<scalar_t><<<grid, block, 0, stream>>>(
        key.data_ptr<scalar_t>(), value.data_ptr<scalar_t>(), slots.data_ptr<int64_t>(),
        key_pages, value_pages, signs.data_ptr<float>(), inv_sqrt, num_rows, heads, head_dim,
        num_slots);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void dequantize_gather(const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& page_table, const at::Tensor& signs, int64_t bits,
                       const at::Tensor& out) {
  TORCH_CHECK(codes.dim() == 4, "codes must be [num_pages, page_size, heads, packed_bytes]");
  TORCH_CHECK(page_table.scalar_type() == at::kInt && page_table.dim() == 2 &&
                  page_table.is_contiguous(), "page_table must be contiguous int32 [B, P]");
  TORCH_CHECK(out.dim() == 4 && out.is_contiguous(), "out must be contiguous [B, P*ps, H, D]");
  const int num_pages = static_cast<int>(codes.size(0));
  const int page_size = static_cast<int>(codes.size(1));
  const int heads = static_cast<int>(codes.size(2));
  const int head_dim = static_cast<int>(out.size(3));
  check_pages(codes, scales, static_cast<int>(bits), head_dim);
  TORCH_CHECK(out.size(0) == page_table.size(0) &&
                  out.size(1) == page_table.size(1) * page_size && out.size(2) == heads,
              "out shape does not match page_table and page size");
  TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.numel() == kGroup, "signs: float32[32]");
  const int64_t num_rows = out.size(0) * out.size(1) * heads;
  if (num_rows == 0) return;
  const c10::cuda::CUDAGuard guard(codes.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const float inv_sqrt = static_cast<float>(1.0 / std::sqrt(static_cast<double>(kGroup)));
  const dim3 block(kGroup, kRowsPerBlock);
  DYNGEN_DISPATCH_ROW_TYPES(out.scalar_type(), "dequantize_gather", [&] {
    dequantize_gather_kernel<scalar_t><<<grid_rows(num_rows), block, 0, stream>>>(
        static_cast<const uint8_t*>(codes.data_ptr()),
        reinterpret_cast<const __half*>(scales.data_ptr()), page_table.data_ptr<int>(),
        signs.data_ptr<float>(), inv_sqrt, out.data_ptr<scalar_t>(), static_cast<int>(bits),
        num_rows, static_cast<int>(page_table.size(1)), page_size, heads, head_dim, num_pages);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void copy_pages(const at::Tensor& table, const at::Tensor& copies, int64_t max_bytes) {
  TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.size(1) == 3,
              "table must be int64 [tensors, 3]");
  TORCH_CHECK(copies.scalar_type() == at::kLong && copies.dim() == 2 && copies.size(1) == 3,
              "copies must be int64 [copies, 3]");
  TORCH_CHECK(table.is_cuda() && copies.is_cuda() && table.is_contiguous() &&
                  copies.is_contiguous(), "table and copies must be contiguous CUDA tensors");
  TORCH_CHECK(table.size(0) <= 65535 && copies.size(0) <= 65535, "too many tensors or copies");
  if (table.size(0) == 0 || copies.size(0) == 0 || max_bytes <= 0) return;
  const c10::cuda::CUDAGuard guard(table.device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  constexpr int threads = 256;
  const int64_t chunks = (max_bytes / 16 + threads - 1) / threads;
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(chunks, 1), 1024)),
                  static_cast<unsigned>(table.size(0)), static_cast<unsigned>(copies.size(0)));
  copy_pages_kernel<<<grid, threads, 0, stream>>>(table.data_ptr<int64_t>(),
                                                   copies.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dyngen
