#pragma once
// What each connection of a ScriptedUpstream brought, kept whole by its accept index: the
// upstream's script keeps a connection's bytes as it ends, the case takes them once that
// connection's record says so. The capture backends of the PROXY protocol and SNI cases.
#include <gtest/gtest.h>

#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "support/loopback.hpp"

namespace zcrelay::test {

class CapturedStreams {
  public:
    // From the script, as connection `index` ends.
    void keep(size_t index, std::string bytes) {
        std::lock_guard lock(mu_);
        by_index_[index] = std::move(bytes);
    }
    // The bytes of connection `index` once it ended, or nullopt with an ADD_FAILURE; its read
    // must have ended at EOF. `who` names the backend in failure messages.
    std::optional<std::string> wait(ScriptedUpstream& up, size_t index, Millis timeout,
                                    const std::string& who = "") {
        std::optional<ConnRecord> rec = up.waitForRecord(index, timeout);
        const std::string prefix = who.empty() ? "" : who + ": ";
        if (!rec) {
            ADD_FAILURE() << prefix << "backend connection " << index << " never ended";
            return std::nullopt;
        }
        EXPECT_EQ(rec->read_end.status, IoStatus::Eof) << prefix << rec->describe();
        std::lock_guard lock(mu_);
        return by_index_[index];
    }

  private:
    std::mutex mu_;
    std::map<size_t, std::string> by_index_;
};

}  // namespace zcrelay::test
