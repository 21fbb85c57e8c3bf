// Our CPU kernels as one torch extension per build (models/native.py compiles it with a build's flags):
// bf16 projections (widened, and tiled where SPECDECODE_TILED), quantized projections, attention, and the
// fused decoder layer that strings them together. See the headers for each kernel's contract.
#include "attention.h"
#include "layer.h"
#include "linear_bf16.h"
#include "linear_blocks.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The compute functions let go of the GIL: a server's event loop keeps running while a step computes.
  const auto free = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("widened_linear", &widened_linear, free);
#ifdef SPECDECODE_TILED
  m.def("tiled_linear", &tiled_linear, free);
#endif
  m.def("tile_outputs", &tile_outputs);
  m.def("quant_linear", &quant_linear, free);
  m.def("quant_tile_outputs", &quant_tile_outputs);
  m.def("quant_record_bytes", &quant_record_bytes);
  m.def("prefetch_level", [] { return sd::prefetch_level.load(); },
        "the cache the quantized kernels prefetch the next tile into: 0 for L1, 1 for L2");
  m.def("set_prefetch_level", [](int level) {
    TORCH_CHECK(level == 0 || level == 1, "prefetch level must be 0 (L1) or 1 (L2), not ", level);
    sd::prefetch_level.store(level);
  });
  m.def("attention", &attention, free);
  m.def("attention_indexed", &attention_indexed, free);
  pybind11::class_<Proj>(m, "Proj", pybind11::module_local())
      .def(pybind11::init<torch::Tensor, int64_t, int64_t, int64_t, c10::optional<torch::Tensor>>())
      .def(pybind11::init<std::vector<Proj>>())
      .def_readonly("fmt", &Proj::fmt)
      .def_readonly("n_out", &Proj::n_out)
      .def_readonly("k_in", &Proj::k_in);
  pybind11::class_<Layer>(m, "Layer", pybind11::module_local())
      .def(pybind11::init<Proj, Proj, Proj, Proj, const torch::Tensor&, const torch::Tensor&, double, int64_t, int64_t,
                          int64_t, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, int64_t, double, int64_t,
                          c10::optional<torch::Tensor>, c10::optional<torch::Tensor>>());
  m.def("layer_qkv", &layer_qkv, free);
  m.def("layer_attend", &layer_attend, free);
  m.def("layer_finish", &layer_finish, free);
  m.def("layer_rows", &layer_rows, free);
  m.def("layers_rows", &layers_rows, free);
  m.def("project_rows", &project_rows, free);
  m.def("rms_norm_rows", &rms_norm_rows, free);
}
