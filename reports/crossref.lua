--[[ crossref.lua: Quarto-style cross-references for the pandoc fallback path.

Quarto numbers `#fig-`, `#tbl-`, `#sec-` and `#eq-` targets and resolves `@fig-x` references.
Plain pandoc does not, so `rlxf report` runs this filter when Quarto is absent. HTML gets
numbered captions and "Figure N" links; Typst gets native labels and `@ref`s, which Typst
numbers itself (so the two paths number identically).
]]

local is_typst = FORMAT:match("typst") ~= nil
local numbers = {}   -- id -> number string
local kinds = { fig = "Figure", tbl = "Table", sec = "Section", eq = "Equation" }
local counters = { fig = 0, tbl = 0, eq = 0 }
local section = {}

local function prefix(id)
  return id and id:match("^(%a+)%-") or nil
end

local function caption_prefix(kind, n)
  return pandoc.Inlines({ pandoc.Strong({ pandoc.Str(kinds[kind] .. "\u{a0}" .. n .. ":") }), pandoc.Space() })
end

local function number_header(h)
  if h.classes:includes("unnumbered") then return nil end
  local level = h.level
  section[level] = (section[level] or 0) + 1
  for l = level + 1, 9 do section[l] = nil end
  local parts = {}
  for l = 1, level do parts[#parts + 1] = tostring(section[l] or 0) end
  local n = table.concat(parts, ".")
  if prefix(h.identifier) == "sec" then numbers[h.identifier] = n end
  return n
end

local function add_caption_prefix(el, kind, n)
  if is_typst then return end
  local blocks = el.caption.long
  if #blocks == 0 then
    el.caption.long = { pandoc.Plain(caption_prefix(kind, n)) }
  else
    local first = blocks[1]
    first.content = caption_prefix(kind, n) .. first.content
  end
end

local function number_block(el)
  if el.t == "Header" then
    number_header(el)
  elseif el.t == "Figure" and prefix(el.identifier) == "fig" then
    counters.fig = counters.fig + 1
    numbers[el.identifier] = tostring(counters.fig)
    add_caption_prefix(el, "fig", counters.fig)
  elseif el.t == "Table" and prefix(el.identifier) == "tbl" then
    counters.tbl = counters.tbl + 1
    numbers[el.identifier] = tostring(counters.tbl)
    add_caption_prefix(el, "tbl", counters.tbl)
  elseif el.t == "Para" then
    -- display math followed by {#eq-id}
    local c = el.content
    for i = 1, #c do
      local m = c[i]
      if m.t == "Math" and m.mathtype == "DisplayMath" then
        local j = i + 1
        while c[j] and c[j].t == "Space" do j = j + 1 end
        local label = c[j] and c[j].t == "Str" and c[j].text:match("^{#(eq%-[%w_-]+)}$")
        if label then
          counters.eq = counters.eq + 1
          numbers[label] = tostring(counters.eq)
          if is_typst then
            -- a native numbered equation with a label, so Typst numbers and resolves @eq-id
            local typ = pandoc.write(pandoc.Pandoc({ pandoc.Plain({ m }) }), "typst")
            local body = typ:match("^%s*%$(.-)%$%s*$") or typ
            c[i] = pandoc.RawInline("typst",
              '#math.equation(block: true, numbering: "(1)", $' .. body .. '$) <' .. label .. ">")
            c[j] = pandoc.Str("")
          else
            m.text = m.text .. "\\qquad(" .. counters.eq .. ")"
            c[j] = pandoc.Span({}, { id = label })
          end
          for k = i + 1, j - 1 do c[k] = pandoc.Str("") end
        end
      end
    end
  end
  return el
end

local function resolve(cite)
  local out = pandoc.Inlines({})
  for i, c in ipairs(cite.citations) do
    local kind = prefix(c.id)
    if not kind or not kinds[kind] then return nil end
    local n = numbers[c.id]
    if not n then
      io.stderr:write("crossref: unresolved reference @" .. c.id .. "\n")
      n = "??"
    end
    if i > 1 then out:insert(pandoc.Str(", ")) end
    local text = kinds[kind] .. "\u{a0}" .. (kind == "eq" and "(" .. n .. ")" or n)
    if is_typst and n ~= "??" then
      out:insert(pandoc.RawInline("typst", "@" .. c.id))
    else
      out:insert(pandoc.Link({ pandoc.Str(text) }, "#" .. c.id))
    end
  end
  return out
end

function Pandoc(doc)
  -- number in document order first, then resolve references anywhere (forward refs too)
  doc.blocks = doc.blocks:walk({ traverse = "topdown", Block = number_block })
  doc.blocks = doc.blocks:walk({ Cite = resolve })
  return doc
end
