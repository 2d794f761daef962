#include "accounts.hpp"

#include <grp.h>
#include <pwd.h>

#include <cerrno>
#include <charconv>
#include <cstring>
#include <string_view>
#include <vector>

#include "units.hpp"

namespace zcrelay {
namespace {

// getpw*_r and getgr*_r write the entry's strings here; ERANGE past it.
constexpr size_t kEntryBuffer = 16384;

// A whole decimal number that fits an id (not the -1 that set*id() reads as "unchanged").
std::optional<uint32_t> numericId(std::string_view text) {
    uint32_t value = 0;
    const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (text.empty() || ec != std::errc() || end != text.data() + text.size() ||
        value == UINT32_MAX)
        return std::nullopt;
    return value;
}

}  // namespace

tl::expected<UserAccount, std::string> lookUpUser(const std::string& user) {
    std::vector<char> buf(kEntryBuffer);
    struct passwd pw {};
    struct passwd* found = nullptr;
    int err = getpwnam_r(user.c_str(), &pw, buf.data(), buf.size(), &found);
    const std::optional<uint32_t> uid = numericId(user);
    if (found == nullptr && uid) err = getpwuid_r(*uid, &pw, buf.data(), buf.size(), &found);
    // Not found is 0, ENOENT or ESRCH, depending on the NSS module; anything else is a failure.
    if (found == nullptr && err != 0 && err != ENOENT && err != ESRCH)
        return tl::unexpected("looking up " + quoted(user) + ": " + std::strerror(err));
    if (found == nullptr && !uid)
        return tl::unexpected(quoted(user) + " is not a user of this system (/etc/passwd, NSS)");
    if (found == nullptr) return UserAccount{*uid, std::nullopt};
    return UserAccount{static_cast<uint32_t>(found->pw_uid), static_cast<uint32_t>(found->pw_gid)};
}

tl::expected<uint32_t, std::string> lookUpGroup(const std::string& group) {
    std::vector<char> buf(kEntryBuffer);
    struct group gr {};
    struct group* found = nullptr;
    const int err = getgrnam_r(group.c_str(), &gr, buf.data(), buf.size(), &found);
    if (found == nullptr && err != 0 && err != ENOENT && err != ESRCH)
        return tl::unexpected("looking up " + quoted(group) + ": " + std::strerror(err));
    const std::optional<uint32_t> gid = numericId(group);
    if (found == nullptr && !gid)
        return tl::unexpected(quoted(group) + " is not a group of this system (/etc/group, NSS)");
    return found != nullptr ? static_cast<uint32_t>(found->gr_gid) : *gid;
}

}  // namespace zcrelay
