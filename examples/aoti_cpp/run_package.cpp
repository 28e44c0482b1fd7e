// Runs an AOTInductor package (torch._inductor.aoti_compile_and_package) of a model whose forward
// is model(x, lengths) -> tensors, in a process without Python.
//
// The package calls fastlayers' operators (torch.ops.fastlayers.lstm_padded, ...): their library
// (fastlayers.ops_library(): the installed package's _native/_C_<variant>.so) is loaded first with dlopen,
// which registers them with LibTorch's dispatcher.
//
// Arguments: OPS_LIBRARY PACKAGE T B F INPUT LENGTHS OUTPUT_PREFIX. INPUT holds x (T, B, F) as raw
// little-endian float32, LENGTHS the B lengths as raw int64; every output k is written as raw
// float32 to OUTPUT_PREFIX.k, and its shape is printed, one line per output.
#include <ATen/ATen.h>
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <dlfcn.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

static at::Tensor read_raw(const std::string& path, at::IntArrayRef shape, at::ScalarType dtype) {
  auto t = at::empty(shape, at::TensorOptions().dtype(dtype));
  std::ifstream in(path, std::ios::binary);
  in.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(t.nbytes()));
  if (!in) throw std::runtime_error("cannot read " + path);
  return t;
}

int main(int argc, char** argv) {
  if (argc != 9) {
    std::cerr << "usage: run_package OPS_LIBRARY PACKAGE T B F INPUT LENGTHS OUTPUT_PREFIX\n";
    return 2;
  }
  if (!dlopen(argv[1], RTLD_NOW | RTLD_GLOBAL)) {
    std::cerr << "cannot load the operator library: " << dlerror() << "\n";
    return 1;
  }
  const int64_t steps = std::stoll(argv[3]), batch = std::stoll(argv[4]), features = std::stoll(argv[5]);
  auto x = read_raw(argv[6], {steps, batch, features}, at::kFloat);
  auto lengths = read_raw(argv[7], {batch}, at::kLong);
  torch::inductor::AOTIModelPackageLoader loader(argv[2]);
  std::vector<at::Tensor> outputs = loader.run({x, lengths});
  for (size_t k = 0; k < outputs.size(); k++) {
    auto out = outputs[k].to(at::kFloat).contiguous();
    std::ofstream(std::string(argv[8]) + "." + std::to_string(k), std::ios::binary)
        .write(static_cast<const char*>(out.data_ptr()), static_cast<std::streamsize>(out.nbytes()));
    std::cout << out.sizes() << "\n";
  }
  return 0;
}
