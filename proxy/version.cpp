#include "version.hpp"

#ifndef ZCRELAY_VERSION
#error "ZCRELAY_VERSION (the release, a string literal) must be defined for this file"
#endif

namespace zcrelay {

const char* releaseVersion() { return ZCRELAY_VERSION; }

}  // namespace zcrelay
