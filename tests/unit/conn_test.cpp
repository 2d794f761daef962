// The connection lifecycle's edges (conn.hpp): the table enter() checks is the diagram drawn
// above ConnState, and an edge it does not draw stops a debug or sanitizer build.
#include "conn.hpp"

#include <gtest/gtest.h>

#include <set>
#include <utility>

namespace zcrelay {
namespace {

using S = ConnState;

// The diagram, edge by edge.
const std::set<std::pair<S, S>> kDrawn = {
    {S::Free, S::Accepted},          {S::Accepted, S::Queued},
    {S::Accepted, S::ReadingProxy},  {S::Accepted, S::Inspecting},
    {S::Accepted, S::Connecting},    {S::Accepted, S::Closing},
    {S::Queued, S::ReadingProxy},    {S::Queued, S::Inspecting},
    {S::Queued, S::Connecting},      {S::Queued, S::Closing},
    {S::ReadingProxy, S::Inspecting}, {S::ReadingProxy, S::Connecting},
    {S::ReadingProxy, S::Closing},   {S::Inspecting, S::Connecting},
    {S::Inspecting, S::Closing},     {S::Connecting, S::Relaying},
    {S::Connecting, S::Closing},     {S::Relaying, S::Closing},
    {S::Closing, S::Free},
    // Across a takeover: handing over, and adopting in the next relay.
    {S::Relaying, S::HandingOver},   {S::HandingOver, S::Relaying},
    {S::HandingOver, S::Closing},    {S::Free, S::Relaying},
};

TEST(ConnLifecycle, EdgesAreExactlyTheDiagram) {
    for (int f = 0; f <= static_cast<int>(S::Closing); ++f) {
        for (int t = 0; t <= static_cast<int>(S::Closing); ++t) {
            auto from = static_cast<S>(f), to = static_cast<S>(t);
            EXPECT_EQ(isEdge(from, to), kDrawn.count({from, to}) == 1)
                << name(from) << " -> " << name(to);
        }
    }
}

TEST(ConnLifecycle, AConnectionWalksItsLongestPath) {
    Conn c;
    for (S to : {S::Accepted, S::Queued, S::ReadingProxy, S::Inspecting, S::Connecting,
                 S::Relaying, S::Closing, S::Free}) {
        enter(c, to);
        EXPECT_EQ(c.state, to);
    }
}

TEST(ConnLifecycleDeathTest, AnEdgeNotDrawnStopsADebugOrSanitizerBuild) {
#if defined(NDEBUG) && !defined(ZCRELAY_SANITIZED)
    GTEST_SKIP() << "a release build logs the bad edge and goes on; sanitize.* runs this";
#else
    Conn c;
    EXPECT_DEATH(enter(c, S::Connecting), "Free -> Connecting is not an edge");
#endif
}

}  // namespace
}  // namespace zcrelay
