// JSON string literals for any bytes: the files Trellis writes (summary.json, config.json, the
// safetensors header) stay valid JSON even where a path is not UTF-8.
#include <gtest/gtest.h>

#include "core/json.hpp"

using trellis::json_string;

TEST(JsonString, EscapesWhatJsonRequiresAndKeepsUtf8) {
  EXPECT_EQ(json_string(""), "\"\"");
  EXPECT_EQ(json_string("runs/gpt2"), "\"runs/gpt2\"");
  EXPECT_EQ(json_string("a\"b\\c"), "\"a\\\"b\\\\c\"");
  EXPECT_EQ(json_string("a\nb\tc\x01\x7f"), "\"a\\u000ab\\u0009c\\u0001\\u007f\"");
  EXPECT_EQ(json_string("caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"),
            "\"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\"");  // é, €, an emoji: as they are
}

TEST(JsonString, BytesThatAreNotUtf8AreEscapedOneByOne) {
  EXPECT_EQ(json_string("bad\xFF"), "\"bad\\u00ff\"");                  // never in UTF-8
  EXPECT_EQ(json_string("\xC3"), "\"\\u00c3\"");                        // cut short
  EXPECT_EQ(json_string("\xC3("), "\"\\u00c3(\"");                      // no continuation
  EXPECT_EQ(json_string("\xC0\x80"), "\"\\u00c0\\u0080\"");              // overlong NUL
  EXPECT_EQ(json_string("\xE0\x80\x80"), "\"\\u00e0\\u0080\\u0080\"");    // overlong
  EXPECT_EQ(json_string("\xED\xA0\x80"), "\"\\u00ed\\u00a0\\u0080\"");    // a surrogate
  EXPECT_EQ(json_string("\xF4\x90\x80\x80"), "\"\\u00f4\\u0090\\u0080\\u0080\"");  // > U+10FFFF
  EXPECT_EQ(json_string("\xE9t\xE9"), "\"\\u00e9t\\u00e9\"");            // Latin-1 "été"
}
