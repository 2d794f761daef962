#include "uring/user_data.hpp"

#include <gtest/gtest.h>

namespace zcrelay {
namespace {

TEST(UserData, RoundTripsEveryField) {
    for (uint32_t slot : {0u, 1u, 4095u, UserData::kMaxSlot}) {
        for (uint32_t gen : {0u, 1u, 0xdeadbeefu, 0xffffffffu}) {
            for (uint8_t dir : {0, 1}) {
                for (uint8_t aux : {0, 5, static_cast<int>(UserData::kMaxAux)}) {
                    UserData ud{Op::Send, dir, slot, gen, aux};
                    EXPECT_EQ(UserData::unpack(ud.pack()), ud)
                        << "slot " << slot << " gen " << gen << " aux " << int{aux};
                }
            }
        }
    }
}

TEST(UserData, FieldsDoNotBleedIntoEachOther) {
    UserData a{Op::PollIn, 1, UserData::kMaxSlot, 0};
    UserData b = UserData::unpack(a.pack());
    EXPECT_EQ(b.op, Op::PollIn);
    EXPECT_EQ(b.generation, 0u);
    EXPECT_EQ(b.dir, 1);
    // A slot past the field's width is masked, never carried into the generation.
    UserData c{Op::Recv, 0, UserData::kMaxSlot + 1, 7};
    EXPECT_EQ(UserData::unpack(c.pack()).generation, 7u);
    EXPECT_EQ(UserData::unpack(c.pack()).slot, 0u);
    // An aux past its width neither: it stays out of the slot.
    UserData d{Op::Send, 0, 3, 9, static_cast<uint8_t>(UserData::kMaxAux + 1)};
    EXPECT_EQ(UserData::unpack(d.pack()).slot, 3u);
    EXPECT_EQ(UserData::unpack(d.pack()).aux, 0);
}

TEST(UserData, OpBitsCompleteATag) {
    // A pump's SQEs are its direction's tag (op 0) with the op and aux ORed in.
    UserData tag{Op::Ignore, 1, 4095, 77};
    UserData full = UserData::unpack(tag.pack() | UserData::opBits(Op::Send, 111));
    EXPECT_EQ(full, (UserData{Op::Send, 1, 4095, 77, 111}));
}

TEST(UserData, ZeroIsIgnore) {
    // Cancel/close SQEs carry user_data 0: it must decode as Op::Ignore.
    EXPECT_EQ(UserData::unpack(0).op, Op::Ignore);
}

}  // namespace
}  // namespace zcrelay
