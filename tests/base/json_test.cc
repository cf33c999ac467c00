#include "agent/base/json.h"

#include "gtest/gtest.h"

namespace fusekeeper {
namespace {

TEST(JsonQuoteTest, QuotesEscapesControlsAndKeepsValidUtf8) {
  EXPECT_EQ(JsonQuote(""), "\"\"");
  EXPECT_EQ(JsonQuote("plain"), "\"plain\"");
  EXPECT_EQ(JsonQuote("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(JsonQuote(std::string("\n\t\x01", 3)), "\"\\u000a\\u0009\\u0001\"");
  EXPECT_EQ(JsonQuote("h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80"), "\"h\xC3\xA9llo \xE2\x82\xAC \xF0\x9F\x98\x80\"");
}

TEST(JsonQuoteTest, InvalidUtf8BecomesTheReplacementCharacter) {
  EXPECT_EQ(JsonQuote("a\xFF" "b"), "\"a\xEF\xBF\xBD" "b\"");
  EXPECT_EQ(JsonQuote("\xC3"), "\"\xEF\xBF\xBD\"") << "a sequence cut short at the end";
  EXPECT_EQ(JsonQuote("\xE2\x82" "x"), "\"\xEF\xBF\xBD\xEF\xBF\xBDx\"") << "each byte of a broken sequence";
}

}  // namespace
}  // namespace fusekeeper
