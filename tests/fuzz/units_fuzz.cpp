// libFuzzer target for the parsers of the config's scalar values: durations, sizes and socket
// addresses. Each is operator input on every load and reload. The first byte picks the parser,
// the rest is the text. Whatever parses must format back to text that parses to the same value
// (the config renderer and the error messages rely on that); whatever fails must say why.
#include <sys/un.h>

#include <cstddef>
#include <cstdint>
#include <string_view>

#include "address.hpp"
#include "units.hpp"

namespace {

using namespace zcrelay;

void check(bool ok) {
    if (!ok) __builtin_trap();
}

void fuzzDuration(std::string_view text) {
    auto d = parseDuration(text);
    if (!d) {
        check(!d.error().empty());
        return;
    }
    check(d->count() >= 0);
    auto again = parseDuration(formatDuration(*d));
    check(again.has_value() && *again == *d);
}

void fuzzSize(std::string_view text) {
    auto s = parseSize(text);
    if (!s) {
        check(!s.error().empty());
        return;
    }
    auto again = parseSize(formatSize(*s));
    check(again.has_value() && *again == *s);
}

void fuzzAddress(std::string_view text) {
    auto a = parseAddress(text);
    if (!a) {
        check(!a.error().empty());
        return;
    }
    check(a->family() == AF_INET || a->family() == AF_INET6 || a->family() == AF_UNIX);
    check(a->length > 0 && a->length <= sizeof(a->storage));
    if (a->family() == AF_UNIX) check(a->length <= sizeof(sockaddr_un));
    auto again = parseAddress(a->toString());
    check(again.has_value() && *again == *a);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
    if (size == 0) return 0;
    std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
    switch (data[0] % 3) {
        case 0: fuzzDuration(text); break;
        case 1: fuzzSize(text); break;
        default: fuzzAddress(text); break;
    }
    return 0;
}
