// The csv dataset: numeric features and a label column, for classification or regression.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "frugal/base/error.h"
#include "frugal/data/data.h"

namespace frugal {
namespace {

/// A parsed CSV file: the header, the feature values row by row and the label fields.
struct CsvTable {
  std::vector<std::string> header;
  size_t label = 0;               ///< the label's column
  std::vector<double> features;   ///< rows x (columns - 1), row-major
  std::vector<std::string> labels;
  std::vector<int64_t> lines;     ///< each row's line in the file (1-based)
  int64_t rows() const { return static_cast<int64_t>(labels.size()); }
  int64_t width() const { return static_cast<int64_t>(header.size()) - 1; }
};

std::string trim_blank(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t\r") - b + 1);
}

/// One line's fields (RFC 4180 quoting within the line).
std::vector<std::string> split_fields(const std::string& line, const std::string& where) {
  std::vector<std::string> out;
  std::string field;
  bool quoted = false, was_quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c == '"' && i + 1 < line.size() && line[i + 1] == '"') field += line[++i];
      else if (c == '"') quoted = false;
      else field += c;
    } else if (was_quoted && c != ',') {
      // After a closing quote only blanks (and a CRLF file's \r) may come before the comma.
      if (c != ' ' && c != '\t' && c != '\r')
        throw_data_error(where + ": '" + std::string(1, c) + "' after the closing quote of field " +
                         std::to_string(out.size() + 1) + " (a quoted field ends at a comma)");
    } else if (c == '"' && trim_blank(field).empty()) {
      quoted = was_quoted = true;
      field.clear();
    } else if (c == ',') {
      out.push_back(was_quoted ? field : trim_blank(field));
      field.clear();
      was_quoted = false;
    } else {
      field += c;
    }
  }
  if (quoted)
    throw_data_error(where + ": a quoted field is not closed on this line (a field may not span "
                     "lines)");
  out.push_back(was_quoted ? field : trim_blank(field));
  return out;
}

/// The field as a finite number, or false.
bool parse_number(const std::string& s, double& v) {
  if (s.empty()) return false;
  char* end = nullptr;
  v = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(v);
}

size_t label_column(const std::vector<std::string>& header, const CsvSpec& spec,
                    const std::string& path) {
  if (spec.label_column.empty()) return header.size() - 1;
  const auto it = std::find(header.begin(), header.end(), spec.label_column);
  if (it != header.end()) return static_cast<size_t>(it - header.begin());
  std::string names;
  for (const auto& h : header) names += (names.empty() ? "'" : ", '") + h + "'";
  throw_data_error("'" + path + "':1: no column '" + spec.label_column +
                   "' (data.label_column); the header has " + names);
}

/// One data row into the table, every feature (and a regression target) checked.
void add_row(CsvTable& t, const std::vector<std::string>& fields, const CsvSpec& spec,
             const std::string& where) {
  if (fields.size() != t.header.size())
    throw_data_error(where + ": " + std::to_string(fields.size()) + " fields, but the header has " +
                     std::to_string(t.header.size()) + " columns");
  for (size_t col = 0; col < fields.size(); ++col) {
    double v = 0;
    const bool is_label = col == t.label;
    if (is_label && !spec.regression) {
      if (fields[col].empty())
        throw_data_error(where + ": column " + std::to_string(col + 1) + " ('" + t.header[col] +
                         "', the label) is empty");
      continue;
    }
    if (!parse_number(fields[col], v))
      throw_data_error(where + ": column " + std::to_string(col + 1) + " ('" + t.header[col] +
                       "'): '" + fields[col] + "' is not a finite number" +
                       (is_label ? " (a regression target)" : " (features must be numeric)"));
    if (!is_label) t.features.push_back(v);
  }
  t.labels.push_back(fields[t.label]);
}

CsvTable read_table(const std::string& path, const CsvSpec& spec) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw_data_error("cannot read '" + path + "': no such file (data.path / data.valid_path)");
  CsvTable t;
  std::string line;
  for (int64_t number = 1; std::getline(in, line); ++number) {
    if (number == 1 && line.rfind("\xEF\xBB\xBF", 0) == 0) line.erase(0, 3);  // Excel's UTF-8 BOM
    if (trim_blank(line).empty()) continue;
    const std::string where = "'" + path + "':" + std::to_string(number);
    std::vector<std::string> fields = split_fields(line, where);
    if (t.header.empty()) {
      if (fields.size() < 2)
        throw_data_error(where + ": the header names " + std::to_string(fields.size()) +
                         " column; a CSV needs at least one feature column and a label column");
      t.header = std::move(fields);
      t.label = label_column(t.header, spec, path);
      continue;
    }
    add_row(t, fields, spec, where);
    t.lines.push_back(number);
  }
  if (in.bad()) throw_data_error("cannot read '" + path + "': read error");
  if (t.rows() == 0)
    throw_data_error("'" + path + "' has no data rows" +
                     (t.header.empty() ? " and no header" : " below its header"));
  return t;
}

/// The label values of a classification, sorted: by value when all are numbers, else as text.
std::vector<std::string> class_names(const CsvTable& t) {
  std::vector<std::string> names(t.labels.begin(), t.labels.end());
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  double a = 0, b = 0;
  const bool numeric = std::all_of(names.begin(), names.end(), [&](const std::string& s) { return parse_number(s, a); });
  if (numeric)
    std::stable_sort(names.begin(), names.end(), [&](const std::string& x, const std::string& y) {
      parse_number(x, a);
      parse_number(y, b);
      return a < b;
    });
  return names;
}

/// Each feature column's mean and standard deviation (1 where a column is constant).
void column_stats(const CsvTable& t, std::vector<double>& mean, std::vector<double>& sd) {
  const int64_t n = t.rows(), f = t.width();
  mean.assign(static_cast<size_t>(f), 0.0);
  sd.assign(static_cast<size_t>(f), 0.0);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < f; ++c) mean[c] += t.features[r * f + c] / static_cast<double>(n);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < f; ++c) sd[c] += std::pow(t.features[r * f + c] - mean[c], 2);
  for (auto& s : sd) {
    s = n > 1 ? std::sqrt(s / static_cast<double>(n - 1)) : 0.0;
    if (s < 1e-12) s = 1.0;
  }
}

torch::Tensor class_labels(const CsvTable& t, const std::vector<std::string>& classes,
                           const std::string& path) {
  std::map<std::string, int64_t> index;
  for (size_t i = 0; i < classes.size(); ++i) index[classes[i]] = static_cast<int64_t>(i);
  auto y = torch::empty({t.rows()}, torch::kLong);
  auto* out = y.data_ptr<int64_t>();
  for (int64_t r = 0; r < t.rows(); ++r) {
    const auto it = index.find(t.labels[r]);
    if (it == index.end())
      throw_data_error("'" + path + "':" + std::to_string(t.lines[r]) + ": column " +
                       std::to_string(t.label + 1) + " ('" + t.header[t.label] + "'): label '" +
                       t.labels[r] + "' is not among the training file's " +
                       std::to_string(classes.size()) + " classes");
    out[r] = it->second;
  }
  return y;
}

}  // namespace

namespace {

/// `t` (read from `path`) as a dataset standardized and labelled with the training split's `ref`.
Dataset csv_dataset(const CsvTable& t, const CsvSpec& spec, const CsvStats& ref, const std::string& path) {
  const int64_t n = t.rows(), f = t.width();
  Dataset d;
  d.features = torch::empty({n, f}, torch::kFloat);
  auto* x = d.features.data_ptr<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t c = 0; c < f; ++c)
      x[r * f + c] = static_cast<float>((t.features[r * f + c] - ref.mean[c]) / ref.sd[c]);
  if (spec.regression) {
    d.labels = torch::empty({n}, torch::kFloat);
    auto* y = d.labels.data_ptr<float>();
    for (int64_t r = 0; r < n; ++r) y[r] = static_cast<float>(std::strtod(t.labels[r].c_str(), nullptr));
    d.num_classes = 1;
  } else {
    d.classes = ref.classes;
    d.labels = class_labels(t, d.classes, path);
    d.num_classes = static_cast<int64_t>(d.classes.size());
  }
  d.feature_names = ref.names;
  d.feature_mean = ref.mean;
  d.feature_std = ref.sd;
  d.name = "csv";
  return d;
}

std::vector<std::string> feature_names(const CsvTable& t) {
  std::vector<std::string> names = t.header;
  names.erase(names.begin() + static_cast<std::ptrdiff_t>(t.label));
  return names;
}

}  // namespace

Dataset load_csv(const std::string& path, const CsvSpec& spec, const std::string& train_path) {
  const CsvTable t = read_table(path, spec);
  const CsvTable train = train_path == path ? CsvTable{} : read_table(train_path, spec);
  const CsvTable& ref = train_path == path ? t : train;
  if (ref.header != t.header)
    throw_data_error("'" + path + "':1: its header differs from the training file '" + train_path +
                     "''s; both need the same columns in the same order");
  CsvStats stats;
  stats.names = feature_names(ref);
  column_stats(ref, stats.mean, stats.sd);
  if (!spec.regression) stats.classes = class_names(ref);
  return csv_dataset(t, spec, stats, path);
}

Dataset load_csv(const std::string& path, const CsvSpec& spec, const CsvStats& train) {
  const CsvTable t = read_table(path, spec);
  if (feature_names(t) != train.names || train.mean.size() != train.names.size() ||
      train.sd.size() != train.names.size())
    throw_data_error("'" + path + "':1: its feature columns differ from the training file's (" +
                     nlohmann::json(train.names).dump() + "); both need the same columns in the same order");
  return csv_dataset(t, spec, train, path);
}

CsvShape csv_shape(const std::string& path, const CsvSpec& spec) {
  const CsvTable t = read_table(path, spec);
  CsvShape s;
  s.rows = t.rows();
  s.features = t.width();
  s.classes = spec.regression ? 1 : static_cast<int64_t>(class_names(t).size());
  return s;
}

}  // namespace frugal
