// Which CPU variant a native library was built for (setup.py compiles this file into each variant,
// with -DFL_VARIANT=<its name>): what fastlayers doctor and the tests read back from the loaded file.
#ifndef FL_VARIANT
#define FL_VARIANT "unknown"
#endif

extern "C" const char* fastlayers_variant() { return FL_VARIANT; }
