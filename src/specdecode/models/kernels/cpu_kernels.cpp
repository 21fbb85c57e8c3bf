// Our CPU kernels as one torch extension per build (models/native.py compiles it with a build's flags):
// bf16 projections (widened, and tiled where SPECDECODE_TILED), quantized projections, attention, and the
// fused decoder layer that strings them together. See the headers for each kernel's contract.
#include "attention.h"
#include "layer.h"
#include "linear_bf16.h"
#include "linear_quant.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("widened_linear", &widened_linear);
#ifdef SPECDECODE_TILED
  m.def("tiled_linear", &tiled_linear);
#endif
  m.def("tile_outputs", &tile_outputs);
  m.def("quant_linear", &quant_linear);
  m.def("quant_tile_outputs", &quant_tile_outputs);
  m.def("quant_record_bytes", &quant_record_bytes);
  m.def("attention", &attention);
  m.def("attention_indexed", &attention_indexed);
  pybind11::class_<Proj>(m, "Proj", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>>())
      .def_readonly("fmt", &Proj::fmt)
      .def_readonly("n_out", &Proj::n_out)
      .def_readonly("k_in", &Proj::k_in);
  pybind11::class_<Layer>(m, "Layer", pybind11::module_local())
      .def(pybind11::init<Proj, Proj, Proj, Proj, const torch::Tensor&, const torch::Tensor&, double, int64_t, int64_t,
                          int64_t>());
  m.def("layer_qkv", &layer_qkv);
  m.def("layer_attend", &layer_attend);
  m.def("layer_finish", &layer_finish);
  m.def("layer_rows", &layer_rows);
  m.def("layers_rows", &layers_rows);
  m.def("project_rows", &project_rows);
  m.def("rms_norm_rows", &rms_norm_rows);
}
