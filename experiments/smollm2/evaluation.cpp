#include "evaluation.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <optional>
#include <sstream>
#include <stdexcept>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli_args.hpp"
#include "dense_attention.hpp"
#include "experiment_drafters.hpp"
#include "experiment_session.hpp"

namespace smollm2 {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::vector<float> log_softmax(const std::vector<float>& logits) {
  const float top = *std::max_element(logits.begin(), logits.end());
  double total = 0.0;
  for (float x : logits) total += std::exp(static_cast<double>(x - top));
  const float lse = top + static_cast<float>(std::log(total));
  std::vector<float> out(logits.size());
  for (std::size_t i = 0; i < logits.size(); ++i) out[i] = logits[i] - lse;
  return out;
}

// Mean and 5th percentile of the finite samples.
struct Summary {
  double mean = 0, p5 = 0;
};
Summary summarize(std::vector<double> samples) {
  samples.erase(std::remove_if(samples.begin(), samples.end(), [](double x) { return !std::isfinite(x); }),
                samples.end());
  if (samples.empty()) return {std::nan(""), std::nan("")};
  double sum = 0;
  for (double x : samples) sum += x;
  const auto k = static_cast<std::size_t>(0.05 * static_cast<double>(samples.size() - 1));
  std::nth_element(samples.begin(), samples.begin() + static_cast<std::ptrdiff_t>(k), samples.end());
  return {sum / static_cast<double>(samples.size()), samples[k]};
}

std::size_t argmax(const std::vector<float>& v) {
  return static_cast<std::size_t>(std::max_element(v.begin(), v.end()) - v.begin());
}

// The best entry of v minus its second best.
double top_margin(const std::vector<float>& v) {
  float first = -INFINITY, second = -INFINITY;
  for (const float x : v) {
    if (x > first) second = first, first = x;
    else if (x > second) second = x;
  }
  return static_cast<double>(first) - static_cast<double>(second);
}

}  // namespace

EvaluationResult evaluate(const LlamaModel& model, const std::vector<std::int32_t>& text,
                          const EvaluationOptions& options, const Progress& progress) {
  const ModelConfig& c = model.config();
  EvaluationResult result;
  result.options = options;
  const int D = options.decode_tokens;
  const int available = static_cast<int>(text.size()) - D - 1;  // every step needs its true next token
  int P = options.prompt_tokens > 0 ? options.prompt_tokens : std::min(available, c.context_length - D - 2);
  if (D < 1) throw std::invalid_argument("--decode-tokens must be positive");
  if (P < 1 || P > available)
    throw std::invalid_argument(fmt::format("the text has {} tokens: too short for a prompt of {} and {} decode tokens",
                                            text.size(), P, D));
  if (P + D + 1 > c.context_length)
    throw std::invalid_argument(fmt::format("prompt {} + decode {} exceeds the model context {}", P, D, c.context_length));
  result.prompt_tokens = P;
  result.decode_tokens = D;
  const std::int64_t capacity = P + D + 2;
  for (const auto& scorer : options.scorers) {  // a bad scorer or constant is refused before any run
    oasiskv::CacheConfig probe;
    probe.shape = model_shape(c);
    probe.max_tokens_per_sequence = capacity;
    apply_scorer(scorer, probe);
    (void)oasiskv::CacheLayout::from(probe);
  }

  // Dense reference: prefill, then D teacher-forced steps; keep the log-probabilities.
  auto t0 = Clock::now();
  DenseKv kv(c.num_layers, c.kv_width(), capacity);
  progress(fmt::format("dense prefill of {} tokens", P));
  const PrefillResult pre = prefill(model, kv, std::span(text.data(), static_cast<std::size_t>(P)));
  progress(fmt::format("dense prefill done in {:.1f} s", seconds_since(t0)));
  std::vector<std::vector<float>> dense_logp(D);
  double dense_nll = 0.0;
  for (int t = 0; t < D; ++t) {
    dense_logp[t] = log_softmax(dense_decode_step(model, kv, text[P + t]));
    dense_nll -= dense_logp[t][text[P + t + 1]];
    if ((t + 1) % 64 == 0) progress(fmt::format("dense decode {}/{}", t + 1, D));
  }
  result.dense_ppl = std::exp(dense_nll / D);
  result.dense_seconds = seconds_since(t0);
  kv.truncate(P);
  progress(fmt::format("dense: ppl {:.3f}, {:.1f} s", result.dense_ppl, result.dense_seconds));

  if (!options.calibrate_profile.empty()) {
    if (options.budgets.size() != 1) {
      throw std::invalid_argument(fmt::format("--calibrate-profile makes a profile for one total budget; {} budgets given",
                                              options.budgets.size()));
    }
    oasiskv::CacheConfig config;
    config.shape = model_shape(c);
    config.block_tokens = options.block_tokens;
    config.sink_tokens = options.sink_tokens.front();
    config.recent_tokens = options.recent_tokens.front();
    config.max_sequences = 1;
    config.max_tokens_per_sequence = capacity;
    config.reduction = options.reductions.front();
    oasiskv::CacheConfig target = config;
    target.budget_tokens = options.budgets.front();
    (void)oasiskv::CacheLayout::from(target);  // a bad budget is refused before the run
    // Every block resident: the attention is exact, so the queries are the dense model's.
    config.budget_tokens = static_cast<int>(oasiskv::CacheLayout::from(config).max_blocks) * config.block_tokens;
    const auto t_run = Clock::now();
    ExperimentSession<float> session(model, config, kv, P, capacity);
    session.start(pre.last_queries);
    StepMetrics m;
    m.want_curves = true;
    std::vector<std::vector<double>> curves(static_cast<std::size_t>(c.num_layers) * c.num_kv_heads);
    for (int t = 0; t < D; ++t) {
      (void)session.step(text[P + t], std::nullopt, &m);
      // Steps have more candidates as the sequence grows: a shorter curve is flat past its end.
      for (std::size_t i = 0; i < curves.size(); ++i) {
        const std::vector<double>& step_curve = m.topk_mass_curve[i];
        std::vector<double>& sum = curves[i];
        if (sum.size() < step_curve.size()) sum.resize(step_curve.size(), sum.empty() ? 0.0 : sum.back());
        for (std::size_t k = 0; k < sum.size(); ++k) sum[k] += step_curve[std::min(k, step_curve.size() - 1)];
      }
      if ((t + 1) % 64 == 0) progress(fmt::format("  calibration step {}/{}", t + 1, D));
    }
    for (auto& curve : curves)
      for (double& x : curve) x /= D;
    const oasiskv::BudgetProfile profile = oasiskv::BudgetProfile::from_mass_curves(target, curves);
    profile.save(options.calibrate_profile);
    std::string line;
    for (int l = 0; l < c.num_layers; ++l) line += fmt::format(" {}", profile.blocks(l, 0));
    progress(fmt::format("calibrated on {} steps in {:.0f} s; layer budgets (kv head 0, blocks):{}; wrote {}", D,
                         seconds_since(t_run), line, options.calibrate_profile));
    return result;
  }

  struct Variant {
    oasiskv::GroupReduction reduction;
    int sinks, recent;
    std::string remainder;
    std::string scorer;
    std::string profile;
  };
  std::vector<Variant> variants;
  for (const auto& profile : options.profiles) {
  for (const auto& scorer : options.scorers) {
   for (const auto& remainder : options.remainders) {
    // Refuses an unknown name or query before any run.
    if (const auto slash = remainder.find('/'); slash != std::string::npos && remainder.substr(slash) != "/prefetch") {
      throw std::invalid_argument("--remainder " + remainder + ": the only query suffix is /prefetch");
    }
    if (const std::string name = remainder.substr(0, remainder.find_first_of("@/")); name != "exact") {
      const std::string base = name.substr(0, name.find_first_of(":*"));
      if (base.rfind("mirror-", 0) != 0) (void)oasiskv::parse_remainder(base);
    }
    for (auto reduction : options.reductions)
      for (int sinks : options.sink_tokens)
        for (int recent : options.recent_tokens) variants.push_back({reduction, sinks, recent, remainder, scorer, profile});
   }
  }
  }
  for (int budget : options.budgets) {
    for (const auto& drafter_name : options.drafters) {
     for (const int K : options.speculate) {
      if (K > 0 && (drafter_name == "previous" || (K > 1 && drafter_name.rfind("early-exit", 0) == 0))) {
        progress(fmt::format("skipping {} with {} drafts per forward: it {}", drafter_name, K,
                             drafter_name == "previous" ? "proposes no token" : "proposes one token at a time"));
        continue;
      }
      for (double ratio : options.fetch_ratios) {
       for (const Variant& variant : variants) {
        const auto t_run = Clock::now();
        oasiskv::CacheConfig config;
        config.shape = model_shape(c);
        config.block_tokens = options.block_tokens;
        config.budget_tokens = budget;
        config.sink_tokens = variant.sinks;
        config.recent_tokens = variant.recent;
        config.fetch_ratio = ratio;
        config.max_sequences = 1;
        config.max_tokens_per_sequence = capacity;
        config.reduction = variant.reduction;
        // NAME[:PARAMETER][@FIRST_LAYER][/prefetch]: layers below FIRST_LAYER merge no remainder;
        // /prefetch estimates the current row from the lookahead query that planned the step
        // (RemainderQuery::prefetch).
        const auto slash = variant.remainder.find('/');
        const std::string name = variant.remainder.substr(0, slash);
        const auto at = name.find('@');
        std::string spec = name.substr(0, at);
        // NAME*SCALE: the estimate's mass multiplied by SCALE (ExperimentSession::set_remainder_mass_scale).
        float mass_scale = 1.0f;
        if (const auto star = spec.find('*'); star != std::string::npos) {
          mass_scale = std::stof(spec.substr(star + 1));
          spec = spec.substr(0, star);
        }
        const bool exact = spec == "exact";
        // mirror-groups:ROWS / mirror-clusters:ROWS / mirror-whole-clusters:ROWS: the mirror's
        // experiments (RemainderMode::grouped / clustered); clusters:ROWS is the cache's estimate
        // with CacheConfig::remainder_cluster_rows.
        const std::string base = spec.substr(0, spec.find(':'));
        const bool quantized = base == "mirror-quant";
        const bool mirrored =
            base == "mirror-groups" || base == "mirror-clusters" || base == "mirror-whole-clusters" || quantized;
        const auto colon = spec.find(':');
        config.remainder = exact || mirrored ? oasiskv::RemainderEstimate::none : oasiskv::parse_remainder(spec.substr(0, colon));
        if (colon != std::string::npos && !mirrored) {
          if (config.remainder == oasiskv::RemainderEstimate::clusters) config.remainder_cluster_rows = std::stoi(spec.substr(colon + 1));
          else if (config.remainder == oasiskv::RemainderEstimate::quantized) config.remainder_bits = std::stoi(spec.substr(colon + 1));
          else throw std::invalid_argument("remainder '" + spec + "': only clusters:R and quantized:B take a parameter");
        }
        apply_scorer(variant.scorer, config);
        // uniform | dense-first:N | a profile file.
        std::optional<oasiskv::BudgetProfile> profile;
        if (variant.profile.rfind("dense-first:", 0) == 0) {
          profile = oasiskv::BudgetProfile::first_layers_dense(config, std::stoi(variant.profile.substr(12)), capacity);
        } else if (variant.profile != "uniform") {
          profile = oasiskv::BudgetProfile::load(variant.profile);
        }
        ExperimentSession<float> session(model, config, kv, P, capacity, profile ? &*profile : nullptr);
        if (exact) session.set_remainder(RemainderMode::exact);
        if (quantized) {
          session.set_remainder(RemainderMode::quantized);
          // mirror-quant:K[xV][d]: keys at K bits, values at V (default K).
          const std::string bits = colon == std::string::npos ? "4" : spec.substr(colon + 1);
          const auto x = bits.find('x');
          session.set_remainder_bits(std::stoi(bits), x == std::string::npos ? 0 : std::stoi(bits.substr(x + 1)));
          session.set_remainder_debias(spec.back() == 'd');
        } else if (mirrored) {
          session.set_remainder(base == "mirror-groups" ? RemainderMode::grouped : RemainderMode::clustered);
          session.set_remainder_whole_clusters(base == "mirror-whole-clusters");
          session.set_remainder_group_rows(colon == std::string::npos ? 16 : std::stoi(spec.substr(colon + 1)));
        }
        if (at != std::string::npos) session.set_remainder_first_layer(std::stoi(name.substr(at + 1)));
        session.set_remainder_mass_scale(mass_scale);
        if (slash != std::string::npos) session.set_remainder_query(RemainderQuery::prefetch);
        auto drafter = make_experiment_drafter(drafter_name, model, session.mirror(), options.early_exit_layers);

        // First working set from the last prompt token's lookahead row.
        std::vector<std::int32_t> history(text.begin(), text.begin() + P);
        if (const auto first_draft = drafter->draft(history, text[P])) {
          session.start(dense_row_queries(model, session.mirror(), *first_draft, P), 1 + K);
        } else {
          session.start(pre.last_queries, 1 + K);  // the first forward carries up to K + 1 rows
        }
        session.cache().reset_statistics();  // traffic per step excludes the initial fill

        RunResult run;
        run.budget = budget;
        run.drafter = drafter_name;
        run.fetch_ratio = ratio;
        run.reduction = variant.reduction;
        run.sink_tokens = variant.sinks;
        run.recent_tokens = variant.recent;
        std::vector<double> agreement, recall, best, err, dropped_true, dropped_est;
        double nll = 0, kl = 0;
        int top1 = 0, draft_hits = 0, drafted = 0;
        StepMetrics m;
        auto add_metrics = [&] {
          agreement.insert(agreement.end(), m.agreement.begin(), m.agreement.end());
          recall.insert(recall.end(), m.mass_recall.begin(), m.mass_recall.end());
          best.insert(best.end(), m.exact_topk_mass.begin(), m.exact_topk_mass.end());
          err.insert(err.end(), m.attn_rel_err.begin(), m.attn_rel_err.end());
          dropped_true.insert(dropped_true.end(), m.dropped_mass_true.begin(), m.dropped_mass_true.end());
          dropped_est.insert(dropped_est.end(), m.dropped_mass_est.begin(), m.dropped_mass_est.end());
        };
        // Position t's logits against the dense reference's.
        auto score = [&](int t, const std::vector<float>& logits) {
          const auto logp = log_softmax(logits);
          nll -= logp[text[P + t + 1]];
          if (argmax(logp) == argmax(dense_logp[t])) {
            ++top1;
          } else {
            run.top1_flip_margins.push_back(top_margin(dense_logp[t]));
          }
          double step_kl = 0.0;
          for (std::size_t i = 0; i < logp.size(); ++i)
            step_kl += std::exp(static_cast<double>(dense_logp[t][i])) * (dense_logp[t][i] - logp[i]);
          kl += step_kl;
        };
        int forwards = 0, proposed = 0, accepted = 0;
        // Speculative decoding with acceptance: K drafts (fewer at the end of the window) run with
        // the current token in one forward; drafts that match the text are kept (teacher forcing:
        // the kept rows are the text's), the rest truncated; the next forward's blocks are planned
        // from this forward's rows at and after the cut. Metrics are of each forward's current row.
        for (int t = 0; K > 0 && t < D;) {
          history.push_back(text[P + t]);
          std::vector<std::int32_t> drafts, scratch = history;
          for (int i = 0; i < std::min(K, D - t - 1); ++i) {  // the drafter's chain, up to K (ends where it abstains)
            const auto d = drafter->draft(scratch, text[P + t + 1 + i]);
            if (!d) break;
            scratch.push_back(drafts.emplace_back(*d));
          }
          const int k = static_cast<int>(drafts.size());
          const auto logits = session.speculate(text[P + t], drafts, &m);
          int a = 0;
          while (a < k && drafts[static_cast<std::size_t>(a)] == text[P + t + 1 + a]) ++a;
          session.accept(a + 1, 1 + K);
          add_metrics();
          for (int r = 0; r <= a; ++r) score(t + r, logits[static_cast<std::size_t>(r)]);
          for (int r = 1; r <= a; ++r) history.push_back(text[P + t + r]);
          ++forwards;
          proposed += k;
          accepted += a;
          draft_hits += k > 0 && drafts[0] == text[P + t + 1];
          drafted += k > 0;
          t += a + 1;
          if ((forwards + 1) % 128 == 0) progress(fmt::format("  budget {} {} K {}: position {}/{}", budget, drafter_name, K, t, D));
        }
        for (int t = 0; K == 0 && t < D; ++t) {
          const std::int32_t token = text[P + t], next = text[P + t + 1];
          history.push_back(token);
          const std::optional<std::int32_t> draft = drafter->draft(history, next);  // none: no lookahead row
          draft_hits += draft == next;
          drafted += draft.has_value();
          score(t, session.step(token, draft, &m));
          add_metrics();
          ++forwards;
          if ((t + 1) % 128 == 0) progress(fmt::format("  budget {} {} ratio {}: step {}/{}", budget, drafter_name, ratio, t + 1, D));
        }
        // Samples are [step][layer][kv head]: per-layer means show where prediction is hard.
        const int per_step = c.num_layers * c.num_kv_heads;
        auto by_layer = [&](const std::vector<double>& samples) {
          std::vector<double> out;
          for (int l = 0; l < c.num_layers; ++l) {
            std::vector<double> layer_samples;
            for (std::size_t i = 0; i < samples.size(); ++i)
              if (static_cast<int>(i % per_step) / c.num_kv_heads == l) layer_samples.push_back(samples[i]);
            out.push_back(summarize(layer_samples).mean);
          }
          return out;
        };
        run.remainder = variant.remainder;
        run.scorer = variant.scorer;
        run.profile = variant.profile == "uniform" || variant.profile.rfind("dense-first:", 0) == 0
                          ? variant.profile
                          : std::filesystem::path(variant.profile).filename().string();
        {
          // err: [step][layer]; dropped mass: [step][layer][query head].
          std::vector<double> e_layer(static_cast<std::size_t>(c.num_layers), 0.0), t_layer(e_layer), s_layer(e_layer);
          std::vector<int> e_n(e_layer.size(), 0), d_n(e_layer.size(), 0);
          for (std::size_t i = 0; i < err.size(); ++i) {
            if (!std::isfinite(err[i])) continue;
            e_layer[i % e_layer.size()] += err[i];
            e_n[i % e_layer.size()] += 1;
          }
          double st = 0, se = 0, stt = 0, see = 0, ste = 0;
          int n = 0;
          for (std::size_t i = 0; i < dropped_true.size(); ++i) {
            const double t = dropped_true[i], e = dropped_est[i];
            if (!std::isfinite(t) || !std::isfinite(e)) continue;
            const std::size_t l = (i / static_cast<std::size_t>(c.num_q_heads)) % e_layer.size();
            t_layer[l] += t;
            s_layer[l] += e;
            d_n[l] += 1;
            st += t, se += e, stt += t * t, see += e * e, ste += t * e;
            ++n;
          }
          for (std::size_t l = 0; l < e_layer.size(); ++l) {
            run.attn_rel_err_by_layer.push_back(e_n[l] ? e_layer[l] / e_n[l] : std::nan(""));
            if (n > 0) {
              run.dropped_mass_true_by_layer.push_back(d_n[l] ? t_layer[l] / d_n[l] : std::nan(""));
              run.dropped_mass_est_by_layer.push_back(d_n[l] ? s_layer[l] / d_n[l] : std::nan(""));
            }
          }
          const double nan = std::nan("");
          run.dropped_mass_true_mean = n ? st / n : nan;
          run.dropped_mass_est_mean = n ? se / n : nan;
          run.dropped_mass_bias = n ? (se - st) / n : nan;
          const double cov = ste / n - (st / n) * (se / n), vt = stt / n - (st / n) * (st / n),
                       ve = see / n - (se / n) * (se / n);
          run.dropped_mass_corr = n && vt > 0 && ve > 0 ? cov / std::sqrt(vt * ve) : nan;
        }
        run.agreement_by_layer = by_layer(agreement);
        run.mass_recall_by_layer = by_layer(recall);
        const auto a = summarize(agreement), r = summarize(recall), b = summarize(best), e = summarize(err);
        run.agreement_mean = a.mean;
        run.agreement_p5 = a.p5;
        run.mass_recall_mean = r.mean;
        run.mass_recall_p5 = r.p5;
        run.exact_topk_mass_mean = b.mean;
        run.attn_rel_err_mean = e.mean;
        run.top1_agreement = static_cast<double>(top1) / D;
        run.kl_mean = kl / D;
        run.ppl = std::exp(nll / D);
        const auto stats = session.cache().statistics().total();
        run.blocks_fetched_per_step = static_cast<double>(stats.blocks_fetched) / D;
        run.bytes_fetched_per_step = static_cast<double>(stats.bytes_fetched) / D;
        run.capped_per_step = static_cast<double>(stats.admits_capped) / D;
        run.resident_recall = stats.recall();
        run.draft_accuracy = !drafter->has_lookahead_row() ? std::nan("")
                             : K > 0                      ? static_cast<double>(draft_hits) / forwards
                                                          : static_cast<double>(draft_hits) / D;
        run.drafted_share = static_cast<double>(drafted) / (K > 0 ? forwards : D);
        run.speculate = K;
        run.forwards = forwards;
        run.acceptance = K > 0 && proposed > 0 ? static_cast<double>(accepted) / proposed : std::nan("");
        run.tokens_per_forward = static_cast<double>(D) / forwards;
        run.blocks_fetched_per_forward = static_cast<double>(stats.blocks_fetched) / forwards;
        run.seconds = seconds_since(t_run);
        progress(fmt::format("budget {:5d} {:10s} K {} ratio {:4.2f} {} sinks {} recent {} remainder {} scorer {} profile {}: agreement {:.4f} recall {:.4f} attn err {:.4f} ppl {:.3f} ({:.0f} s)",
                             budget, drafter_name, K, ratio, oasiskv::reduction_name(variant.reduction), variant.sinks,
                             variant.recent, variant.remainder, variant.scorer, run.profile, run.agreement_mean, run.mass_recall_mean,
                             run.attn_rel_err_mean, run.ppl, run.seconds));
        if (!run.top1_flip_margins.empty()) {
          progress(fmt::format("  {} top-1 flips, at dense margins {:.4f}", run.top1_flip_margins.size(),
                               fmt::join(run.top1_flip_margins, " ")));
        }
        result.runs.push_back(run);
       }
      }
     }
    }
  }
  return result;
}

namespace {
std::string number(double x) {
  if (!std::isfinite(x)) return "null";
  return fmt::format("{:.6g}", x);
}
std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char ch : s) {
    if (ch == '"' || ch == '\\') out += '\\';
    out += ch;
  }
  return out + "\"";
}
}  // namespace

std::string to_json(const EvaluationResult& r) {
  const auto& o = r.options;
  std::ostringstream s;
  s << "{\"model\": " << quoted(o.model_name) << ", \"text\": " << quoted(o.text_name)
    << ", \"prompt_tokens\": " << r.prompt_tokens << ", \"decode_tokens\": " << r.decode_tokens
    << ", \"block_tokens\": " << o.block_tokens << ", \"early_exit_layers\": " << o.early_exit_layers << ",\n \"dense\": {\"ppl\": " << number(r.dense_ppl)
    << ", \"seconds\": " << number(r.dense_seconds) << "},\n \"runs\": [";
  for (std::size_t i = 0; i < r.runs.size(); ++i) {
    const auto& x = r.runs[i];
    s << (i ? ",\n  " : "\n  ") << "{\"budget\": " << x.budget << ", \"drafter\": " << quoted(x.drafter)
      << ", \"fetch_ratio\": " << number(x.fetch_ratio)
      << ", \"reduction\": " << quoted(std::string(oasiskv::reduction_name(x.reduction)))
      << ", \"sink_tokens\": " << x.sink_tokens << ", \"recent_tokens\": " << x.recent_tokens
      << ", \"agreement_mean\": " << number(x.agreement_mean)
      << ", \"agreement_p5\": " << number(x.agreement_p5) << ", \"mass_recall_mean\": " << number(x.mass_recall_mean)
      << ", \"mass_recall_p5\": " << number(x.mass_recall_p5)
      << ", \"exact_topk_mass_mean\": " << number(x.exact_topk_mass_mean)
      << ", \"attn_rel_err_mean\": " << number(x.attn_rel_err_mean) << ", \"top1_agreement\": " << number(x.top1_agreement)
      << ", \"kl_mean\": " << number(x.kl_mean) << ", \"ppl\": " << number(x.ppl)
      << ", \"blocks_fetched_per_step\": " << number(x.blocks_fetched_per_step)
      << ", \"bytes_fetched_per_step\": " << number(x.bytes_fetched_per_step)
      << ", \"capped_per_step\": " << number(x.capped_per_step) << ", \"draft_accuracy\": " << number(x.draft_accuracy)
      << ", \"drafted_share\": " << number(x.drafted_share)
      << ", \"resident_recall\": " << number(x.resident_recall) << ", \"seconds\": " << number(x.seconds)
      << ", \"speculate\": " << x.speculate << ", \"acceptance\": " << number(x.acceptance)
      << ", \"tokens_per_forward\": " << number(x.tokens_per_forward) << ", \"forwards\": " << x.forwards
      << ", \"blocks_fetched_per_forward\": " << number(x.blocks_fetched_per_forward);
    auto array = [&](const char* name, const std::vector<double>& v) {
      s << ", \"" << name << "\": [";
      for (std::size_t j = 0; j < v.size(); ++j) s << (j ? ", " : "") << number(v[j]);
      s << "]";
    };
    array("agreement_by_layer", x.agreement_by_layer);
    array("mass_recall_by_layer", x.mass_recall_by_layer);
    s << ", \"remainder\": " << quoted(x.remainder) << ", \"profile\": " << quoted(x.profile) << ", \"dropped_mass_true_mean\": " << number(x.dropped_mass_true_mean)
      << ", \"dropped_mass_est_mean\": " << number(x.dropped_mass_est_mean)
      << ", \"dropped_mass_bias\": " << number(x.dropped_mass_bias)
      << ", \"dropped_mass_corr\": " << number(x.dropped_mass_corr);
    array("attn_rel_err_by_layer", x.attn_rel_err_by_layer);
    array("dropped_mass_true_by_layer", x.dropped_mass_true_by_layer);
    array("dropped_mass_est_by_layer", x.dropped_mass_est_by_layer);
    array("top1_flip_margins", x.top1_flip_margins);
    s << ", \"scorer\": " << quoted(x.scorer) << "}";
  }
  s << "\n]}\n";
  return s.str();
}

std::string to_table(const EvaluationResult& r) {
  std::string out = fmt::format("prompt {} tokens, decode {} tokens, dense ppl {:.3f}\n", r.prompt_tokens,
                                r.decode_tokens, r.dense_ppl);
  out += fmt::format("{:<11} {:>4} {:>4} {:>6} {:<10} {:>5} {:>2} | {:>7} {:>7} | {:>7} {:>7} {:>7} {:>6} | {:>8} {:>6} {:>8} {:>7} | {:>8} {:>7} {:>6} | {:>6} {:>7} {:>7} | {:<9} {:>7} {:>7} {:>6} | {:<12} {}\n",
                     "reduction", "sink", "rcnt", "budget", "drafter", "ratio", "K", "agree", "agr p5", "recall", "rec p5", "best",
                     "hits", "attn err", "top1", "KL", "ppl", "blk/step", "capped", "draft", "accept", "tok/fwd", "blk/fwd",
                     "remainder", "drop", "est", "corr", "scorer", "profile");
  for (const auto& x : r.runs) {
    out += fmt::format("{:<11} {:>4} {:>4} {:>6} {:<10} {:>5.2f} {:>2} | {:>7.4f} {:>7.4f} | {:>7.4f} {:>7.4f} {:>7.4f} {:>6.3f} | {:>8.4f} {:>6.3f} {:>8.5f} {:>7.3f} | {:>8.1f} {:>7.1f} {:>6.3f} | {:>6.3f} {:>7.2f} {:>7.1f}",
                       oasiskv::reduction_name(x.reduction), x.sink_tokens, x.recent_tokens, x.budget, x.drafter,
                       x.fetch_ratio, x.speculate, x.agreement_mean, x.agreement_p5, x.mass_recall_mean,
                       x.mass_recall_p5, x.exact_topk_mass_mean, x.resident_recall, x.attn_rel_err_mean, x.top1_agreement,
                       x.kl_mean, x.ppl, x.blocks_fetched_per_step, x.capped_per_step, x.draft_accuracy, x.acceptance,
                       x.tokens_per_forward, x.blocks_fetched_per_forward);
    out += fmt::format(" | {:<9} {:>7.4f} {:>7.4f} {:>6.3f} | {:<12} {}\n", x.remainder, x.dropped_mass_true_mean,
                       x.dropped_mass_est_mean, x.dropped_mass_corr, x.scorer, x.profile);
  }
  return out;
}

}  // namespace smollm2
