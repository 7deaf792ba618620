// Included first in every C++ compile step of Horovod's build (launch/cxx17.sh): standard headers
// that Horovod 0.28.1's own use without including them (std::string, uint8_t, std::logic_error and
// more), which GCC 12's headers happened to pull in and GCC 13's no longer do.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
