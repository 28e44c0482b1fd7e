// Which CPU variant a native library was built for (setup.py compiles this file into each variant,
// with -DFL_VARIANT=<its name>): what fastlayers doctor and the tests read back from the loaded file.
#ifndef FL_VARIANT
#define FL_VARIANT "unknown"
#endif

extern "C" const char* fastlayers_variant() { return FL_VARIANT; }

// The torch this library was built against, as bytes in the file: fastlayers._native reads them
// before it loads the file (loading registers the operators with the running torch, whose C++ ABI
// may be another release's).
#include <torch/version.h>
extern "C" __attribute__((used)) const char fastlayers_built_against[] = "fastlayers-torch-version:" TORCH_VERSION;
