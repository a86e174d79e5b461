// Argument checks and their messages without any of torch's C++ API, so that kernels built
// against torch's stable ABI (csrc/cpu/) and those built against ATen (csrc/cuda/) raise the same
// texts. The message is exactly what the arguments print: no function, file or line is added
// (STD_TORCH_CHECK adds them), because the Python side matches "^zerofast: ... [errno N]" to
// turn an I/O failure back into an OSError, and the tests match the texts.
#pragma once

#include <torch/headeronly/core/DeviceType.h>

#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>

// The message arguments are evaluated only on failure, as TORCH_CHECK's are: a check per
// segment row must not allocate, nor ask torch for a tensor's numel, when it passes.
#define ZF_CHECK(cond, ...)                                \
  do {                                                     \
    if (__builtin_expect(!(cond), 0)) ::zerofast::fail(__VA_ARGS__); \
  } while (0)

namespace zerofast {

// A std::runtime_error reaches Python as a RuntimeError carrying exactly this text, from a
// stable-ABI kernel and from an ATen one alike.
template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream text;
  (text << ... << args);
  throw std::runtime_error(text.str());
}

// A tensor's sizes as torch prints them, "[2, 3]", from any array of int64 (at::IntArrayRef,
// the stable Tensor's sizes()).
template <typename Sizes>
std::string sizes_text(const Sizes& sizes) {
  std::string text = "[";
  for (size_t i = 0; i < sizes.size(); ++i) text += (i ? ", " : "") + std::to_string(sizes[i]);
  return text + "]";
}

// A device as torch prints it ("cpu", "cuda:0"), from its type and index, which both at::Device
// and torch::stable::Device give; the name of another type is its number, as no message needs it.
template <typename Device>
std::string device_text(const Device& device) {
  std::string name;
  switch (device.type()) {
    case c10::DeviceType::CPU: name = "cpu"; break;
    case c10::DeviceType::CUDA: name = "cuda"; break;
    case c10::DeviceType::Meta: name = "meta"; break;
    case c10::DeviceType::PrivateUse1: name = "privateuseone"; break;
    default: name = "device type " + std::to_string(static_cast<int>(device.type())); break;
  }
  return device.index() >= 0 ? name + ":" + std::to_string(static_cast<int>(device.index())) : name;
}

}  // namespace zerofast
