#pragma once
// The accounts of this machine (passwd, group, and whatever NSS adds), by name or by number, for
// the config's `user` and `group`. Looked up while the config loads, so that an unknown one is
// refused with its line like any other error; the switch itself is dropPrivileges()
// (privileges.hpp), once the listeners are bound.
#include <cstdint>
#include <optional>
#include <string>
#include <tl/expected.hpp>

namespace zcrelay {

struct UserAccount {
    uint32_t uid = 0;
    std::optional<uint32_t> gid;  // its primary group; none for a bare uid without a passwd entry
};

// A user name, or a uid written as a number, which needs no passwd entry. Errors read
// "\"bob\" is not a user of this system (/etc/passwd, NSS)" or "looking up \"bob\": <errno>".
tl::expected<UserAccount, std::string> lookUpUser(const std::string& user);
// A group name, or a gid written as a number; errors as lookUpUser's.
tl::expected<uint32_t, std::string> lookUpGroup(const std::string& group);

}  // namespace zcrelay
