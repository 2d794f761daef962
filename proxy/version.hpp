#pragma once
// The release a binary is: what --version prints, zcrelay_build_info's version label, the log's
// first line, and what each side of a takeover tells the other.
//
// It lives in an object of its own (version.cpp, compiled with ZCRELAY_VERSION), linked into each
// executable rather than baked into proxy_core, so the same code links as two releases: the
// upgrade tests take a relay from one binary to another that reports a different version
// (proxy/CMakeLists.txt, zcrelay-next), as a package upgrade does.

namespace zcrelay {

const char* releaseVersion();

}  // namespace zcrelay
