// Python bindings of the quantized KV cache kernels (quant_cache_kernels.cu).
// Built lazily by dyngen_core/storage/native.py; see that module for when and how.

#include <torch/extension.h>

namespace dyngen {
void quantize_write(const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                    const at::Tensor& key_codes, const at::Tensor& key_scales,
                    const at::Tensor& value_codes, const at::Tensor& value_scales,
                    const at::Tensor& signs, int64_t key_bits, int64_t value_bits);
void dequantize_gather(const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& page_table, const at::Tensor& signs, int64_t bits,
                       const at::Tensor& out);
void copy_pages(const at::Tensor& table, const at::Tensor& copies, int64_t max_bytes);
}  // namespace dyngen

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dyngen quantized KV cache kernels";
  m.def("quantize_write", &dyngen::quantize_write,
        "Quantize key/value rows [T, H, D] into paged codes and scales at flat slots",
        py::arg("key"), py::arg("value"), py::arg("slots"), py::arg("key_codes"),
        py::arg("key_scales"), py::arg("value_codes"), py::arg("value_scales"),
        py::arg("signs"), py::arg("key_bits"), py::arg("value_bits"));
  m.def("dequantize_gather", &dyngen::dequantize_gather,
        "Dequantize the pages of a page table [B, P] into out [B, P * page_size, H, D]",
        py::arg("codes"), py::arg("scales"), py::arg("page_table"), py::arg("signs"),
        py::arg("bits"), py::arg("out"));
  m.def("copy_pages", &dyngen::copy_pages,
        "Copy slot ranges between pages of many tensors (independent copies in one launch)",
        py::arg("table"), py::arg("copies"), py::arg("max_bytes"));
}
